"""`python -m prm.search`: PRM-guided search. The code: prm/searching/search.py."""
from prm.searching.search import main

if __name__ == "__main__":
    main()
