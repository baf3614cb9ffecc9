"""`python -m prm.label`: step labels by Monte-Carlo rollouts. The code: prm/labeling/label.py."""
from prm.labeling.label import main

if __name__ == "__main__":
    main()
