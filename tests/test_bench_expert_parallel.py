"""``python -m bench.expert_parallel`` end to end on the CPU (gloo, two ranks)."""

import json

from bench import expert_parallel, provenance

ARGS = ["--device", "cpu", "--world", "2", "--models", "cpu-mixtral", "--T", "4,16",
        "--iters", "2", "--mode", "capacity"]


def test_cpu_smoke_run_writes_its_cases(tmp_path, capsys):
    assert expert_parallel.main([*ARGS, "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu-x2-expert_parallel.json").read_text())
    assert result["suite"] == "expert_parallel" and result["world"] == 2
    assert tuple(result["provenance"]) == provenance.FIELDS
    assert result["provenance"]["gpu"] is None and result["provenance"]["host"]
    assert result["command"].startswith("python -m bench.expert_parallel --device cpu")
    assert [(c["model"], c["T"], c["mode"]) for c in result["cases"]] == [
        ("cpu-mixtral", 4, "capacity"), ("cpu-mixtral", 16, "capacity")]
    for case in result["cases"]:
        assert case["ms"] > 0 and case["exchange_ms"] > 0 and case["alltoall_gbps"] > 0
        # capacity mode: W * C rows each way, C = T * top_k, half of them to the other rank
        assert case["bytes_per_rank"] == 2 * case["T"] * 2 * 256 * 2
    assert "| cpu-mixtral | 16 | capacity |" in capsys.readouterr().out


def test_cpu_run_without_out_dir_saves_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert expert_parallel.main([*ARGS[:-4], "--T", "4", "--iters", "1"]) == 0
    captured = capsys.readouterr()
    assert "not saved (a CPU run; --out-dir to save)" in captured.err
    assert "| cpu-mixtral | 4 | exact |" in captured.out
    assert list(tmp_path.iterdir()) == []


def test_more_ranks_than_gpus_is_refused(capsys):
    assert expert_parallel.main(["--device", "cuda", "--world", "64"]) == 2
    assert "needs that many GPUs" in capsys.readouterr().err
