"""`python -m prm.bench`: time the real training loop; `--gpu-check` for a GPU machine. The code: prm/tools/."""
from prm.errors import exit_status
from prm.tools.bench import main

if __name__ == "__main__":
    with exit_status():
        main()
