"""`python -m prm.convert`: any supported dataset as stepwise JSONL. The code: prm/readers/convert.py."""
from prm.readers.convert import main

if __name__ == "__main__":
    main()
