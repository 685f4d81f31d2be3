"""`make perf`'s overhead benchmark (benchmarks/overhead.py) runs and reports both of its figures."""

from benchmarks import overhead


def test_overhead_benchmark_reports_the_harness_ratio_and_the_tracker_slowdown(tmp_path, capsys):
    assert overhead.main(["--batch-size", "2", "--pairs", "2", "--warmup", "0", "--threads", "1",
                          "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "harness overhead: membench's timed step / the article's bare loop = " in out
    assert "tracker slowdown: a step under the exact live-tensor tracker" in out
    assert (tmp_path / "overhead.json").is_file()


def test_overhead_benchmark_rejects_a_bad_count(capsys):
    assert overhead.main(["--pairs", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
