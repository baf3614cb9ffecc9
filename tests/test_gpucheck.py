"""prm.tools.gpucheck's inputs: the data file is sized from the bench flags by name, in any order."""
from prm.tools import gpucheck


def test_the_data_file_is_sized_by_flag_name(tmp_path, monkeypatch):
    flags = "--dtype fp32 --pack-to 256 --max-length 128 --batch-size 2 --steps 3".split()  # another order
    monkeypatch.setitem(gpucheck.FLAGS, "dry", flags)
    model_dir, data, bench = gpucheck.write_inputs(str(tmp_path), dry=True)
    with open(data) as f:
        assert len(f.readlines()) == int(3 * 2 * 1.25) + 8  # --steps x --batch-size with the margin
    assert bench == ["--model", model_dir, "--dataset", data, *flags]
