"""The package installs: pip builds the checkout's tracked files into a fresh virtual environment (offline: no build
isolation, no dependencies fetched), and PRMReward imports from another folder. Depends on: pytest, git, pip."""
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def test_pyproject_dependencies_are_requirements_txt():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        required = [line for line in f if not line.lstrip().startswith("#")]
    assert sorted(project["dependencies"] + project["optional-dependencies"]["test"]) == \
        sorted(line.strip() for line in required if line.strip())


def test_the_readmes_set_up_installs_the_package_and_ci_runs_its_lines():
    """The README's set-up installs the checkout itself beside a CPU torch (so `import prm` works
    from any folder), and .ci/run runs exactly its install and test lines."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    lines = readme.split("## Set up", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    setup, tests = lines[0], lines[-1]
    pip = shlex.split(setup.split(" && ")[1])
    assert pip[:2] == [".venv/bin/pip", "install"] and "torch==2.13.0" in pip
    assert "." in pip  # the project (`-e .` or `.`), not only its requirements
    assert tests.endswith("-m pytest -q -rs tests")
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line for line in f.read().splitlines() if line and not line.startswith("#")]
    assert ci[-2:] == [setup, tests]


def test_installed_package_scores_from_another_folder(tmp_path, model_dir):
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    src = tmp_path / "clone"  # what a clone holds: tracked files only, so the build leaves the checkout untouched
    for name in listed.stdout.splitlines() + ["pyproject.toml"]:
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(src / os.path.dirname(name), exist_ok=True)
            shutil.copy(os.path.join(ROOT, name), src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # pip: this one's
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (torch, transformers, ...) and the build backend (setuptools) are this interpreter's: a .pth
    # puts them on the new one's path, so nothing is downloaded
    deps = [p for p in sys.path if p.endswith("site-packages")]
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write("\n".join(deps) + "\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-build-isolation",
                          "--no-index", str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the README's GRPOTrainer reward, imported from the package's top as a user does, outside the checkout
    snippet = ("import prm; print(prm.__file__); "
               f"print(prm.PRMReward({model_dir!r}, aggregate='min')(['count from 1:'], ['1+1=2\\n2+1=3\\n']))")
    got = subprocess.run([py, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    where, rewards = got.stdout.splitlines()[-2:]
    assert where.startswith(site)  # the installed copy, not the checkout
    from prm.scoring.reward import PRMReward
    here = PRMReward(model_dir, aggregate="min")(["count from 1:"], ["1+1=2\n2+1=3\n"])
    assert json.loads(rewards) == pytest.approx(here, abs=1e-6)  # the checkout's figure
