"""`python -m prm.serve`: the reward server (OpenRLHF's remote reward protocol). The code: prm/scoring/serve.py."""
from prm.scoring.serve import main

if __name__ == "__main__":
    main()
