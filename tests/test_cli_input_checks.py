"""Values checked before the first case: a bad or absurd option, a suite that is not valid text or YAML, an option
value that fits none of the run's cases, each refused in one line with exit code 2 that names the value and the limit
or the valid choices; a value that fits some cases is a row for the others.

The CLI runs in this process (tests/cli_helpers.py) except where a real process is the point. Cases are tiny
(deep_mlp with 4 layers of width 8, batch 2, eval, one step, one thread).
"""


import pytest

from bench.core import results
from bench.core.errors import UnsupportedValue, UsageError
from bench.run import preflight
from cli_helpers import TINY, cli as _cli, cli_many, main_in_process as _main, one_line_exit_2 as _one_line_exit_2


def test_a_value_for_one_case_is_its_row_and_a_value_for_none_stops_before_the_first(tmp_path):
    """Checkpoint:segments=8 cannot apply to a 4-unit model but can to a 12-unit one: in a run over both, the 4-unit
    case is `unsupported` and the cases after it still run. A value that fits none of the run's cases
    (segments=999 on the 4-unit model alone, segments=0 anywhere) is exit 2 before any case, nothing written."""
    suite = tmp_path / "two.yaml"
    suite.write_text("strategies: [del_intermediates, 'checkpoint:segments=8']\n"
                     "workloads: ['deep_mlp:layers=4:width=8', 'deep_mlp:layers=12:width=8']\n"
                     "phases: [eval]\nbatch_sizes: [2]\nwarmup: 0\nsteps: 1\n", encoding="utf-8")
    done = _main("run", "--suite", suite, "--device", "cpu", "--threads", "1", "--no-isolate", "--out", tmp_path / "run")
    assert done.returncode == 0, done.stderr[-2000:]
    frame = results.read_results(next((tmp_path / "run").glob("*.csv"))).set_index(["workload", "strategy"])
    small = frame.loc[("deep_mlp:layers=4:width=8", "checkpoint:segments=8")]
    assert small["status"] == "unsupported" and "segments=8 exceeds the 4" in small["message"]
    assert frame.loc[("deep_mlp:layers=12:width=8", "checkpoint:segments=8"), "status"] != "unsupported"
    assert (frame.xs("del_intermediates", level="strategy")["status"] == "ok").all()

    for value in ("999", "0"):
        out = tmp_path / f"never-{value}"
        done = _main("compare", "--strategies", f"del_intermediates,checkpoint:segments={value}", *TINY, "--out", out)
        _one_line_exit_2(done, f"segments={value}")
        assert not list(out.glob("*.csv")) and "[1/" not in done.stderr


@pytest.mark.parametrize("args, names", [
    (["compare", "--strategies", "baseline", *TINY[:-3], "--threads", "4096"], ["--threads", "4096", "cores"]),
    (["compare", "--strategies", "baseline", *TINY, "--steps", "100000000"], ["--steps", f"{preflight.MAX_STEPS:,}"]),
    (["compare", "--strategies", "baseline", *TINY, "--warmup", "100000000"], ["--warmup", "limit"]),
    # about a petabyte for one step: more than any machine's memory, found on the meta device with none used
    (["compare", "--strategies", "baseline", *TINY, "--batch-size", "1000000000000"],
     ["--batch-size", "memory", "below"]),
    (["fit", "--budget", "1000TiB", "--workload", "deep_mlp:layers=4:width=8"], ["--budget", "memory"]),
])
def test_valid_but_absurd_values_are_errors_that_name_the_limit(tmp_path, args, names):
    done = (_cli if "--threads" in args else _main)(*args, "--out", tmp_path / "out")
    _one_line_exit_2(done, *names)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.csv"))


@pytest.mark.parametrize("args, option", [
    (["compare", "--strategies", "baseline", "--threads", "0"], "--threads"),
    (["compare", "--strategies", "baseline", "--repeats", "-1"], "--repeats"),
    (["compare", "--strategies", "baseline", "--steps", "0"], "--steps"),
    (["compare", "--strategies", "baseline", "--warmup", "-1"], "--warmup"),
    (["compare", "--strategies", "baseline", "--steps", "many"], "--steps"),
    (["compare", "--strategies", "baseline", "--batch-size", "0"], "--batch-size"),
    (["compare", "--strategies", "baseline", "--phases", "test"], "--phases"),
    (["compare", "--strategies", "baseline", "--data", "mnist"], "--data"),
    (["compare", "--strategies", "nonsense"], "--strategies"),
    (["compare", "--strategies", "baseline", "--memory-limit", "lots"], "--memory-limit"),
    (["fit", "--budget", "lots"], "--budget"),
    (["fit", "--budget", "1GiB", "--time-steps", "-1"], "--time-steps"),
    (["fit", "--budget", "1GiB", "--max-batch", "0"], "--max-batch"),
    (["fit", "--budget", "1GiB", "--phase", "test"], "--phase"),
    (["predict", "--engine", "gpu"], "--engine"),
    (["predict", "--phases", "test"], "--phase"),
])
def test_error_messages_name_the_option(args, option, capsys):
    from bench.cli.main import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert option in err and err.count("\n") == 1, err


def test_the_issue_example_threads_0_names_threads_in_a_subprocess():
    _one_line_exit_2(_cli("compare", "--strategies", "baseline", "--threads", "0"), "--threads")


@pytest.mark.parametrize("content", [b"strategies: [baseline]\n\x00\x01\x02\xff", "strategies: [baseline]  # caf\xe9\n"
                                     .encode("latin-1"), bytes(range(256))])
def test_a_suite_that_is_not_utf8_text_is_a_malformed_suite(tmp_path, content):
    suite = tmp_path / "suite.yaml"
    suite.write_bytes(content)
    run = _cli if content == bytes(range(256)) else _main
    _one_line_exit_2(run("run", "--suite", suite, "--out", tmp_path / "out"), str(suite))


def test_an_option_value_that_fits_no_case_stops_before_the_first(tmp_path):
    """Checkpoint:segments=999 on a 10-unit workload: one line and exit 2 before any case runs, not minutes of
    other cases first."""
    done = _main("run", "--strategies", "inplace_relu,checkpoint:segments=999", "--phases", "train", "--device", "cpu",
                "--quick", "--out", tmp_path)
    assert done.returncode == 2 and not list(tmp_path.glob("*.csv"))
    assert done.stderr.strip().splitlines() == [
        "error: checkpoint:segments=999 exceeds the 10 checkpoint units of workload 'captcha_resnet18': the value fits "
        "none of this run's cases, so nothing was run"]


def test_an_option_value_that_fits_some_cases_is_an_unsupported_row_for_the_others():
    from bench.run.preflight import check_cases
    from bench.run.case import Case, bind_case

    small, large = "deep_mlp:layers=4:width=8", "deep_mlp:layers=12:width=8"
    cases = [Case(workload, "checkpoint:segments=8", "train", 2, "cpu") for workload in (small, large)]
    check_cases(cases, bind_case)  # fits the 12-unit model: the 4-unit one's case becomes its row
    with pytest.raises(UsageError, match="segments=8 exceeds the 4 checkpoint units"):
        check_cases(cases[:1], bind_case)
    strategy, context = bind_case(cases[0])
    with pytest.raises(UnsupportedValue):
        strategy.check(context)


ALIAS_BOMB = """
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
"""


BOMB_KEYS = ["warmup", "data", "workload", "executor", "ray_address", "target_ci", "strategies"]
TEN_THOUSAND_DIGITS = "9" * 10_000
LONG_NUMBERS = {
    "strategy-option": ["compare", "--strategies", f"checkpoint:segments={TEN_THOUSAND_DIGITS}"],
    "steps": ["compare", "--strategies", "baseline", "--steps", TEN_THOUSAND_DIGITS],
    "int-option": ["compare", "--strategies", f"grad_accumulation:micro_batches={TEN_THOUSAND_DIGITS}"],
    "batch-size": ["predict", "--batch-size", TEN_THOUSAND_DIGITS],
}


@pytest.fixture(scope="module")
def hostile_values(tmp_path_factory) -> dict:
    """Each alias bomb, the long suite value and the long numbers through the CLI, all in one real process (one
    import of torch, where a process each took eleven), under an address-space limit: a bomb that expands again
    takes that process down, not the test session."""
    folder = tmp_path_factory.mktemp("hostile-values")
    runs = {}
    for key in BOMB_KEYS:
        suite = folder / f"bomb-{key}.yaml"
        strategies = "" if key == "strategies" else "strategies: [baseline]\n"
        suite.write_text(f"{ALIAS_BOMB}\n{strategies}{key}: *h\n", encoding="utf-8")
        runs[f"bomb-{key}"] = ["run", "--suite", suite, "--device", "cpu", "--out", folder / "out"]
    suite = folder / "long.yaml"
    suite.write_text("strategies: [baseline]\nexecutor: " + "x" * 100_000 + "\n", encoding="utf-8")
    runs["long-value"] = ["run", "--suite", suite, "--device", "cpu", "--out", folder / "out"]
    for name, args in LONG_NUMBERS.items():
        runs[name] = [*args, "--device", "cpu", "--out", folder / "out"]
    return dict(zip(runs, cli_many(*runs.values(), timeout=120)))


@pytest.mark.parametrize("key", BOMB_KEYS)
def test_a_yaml_alias_bomb_in_a_suite_is_one_short_line(hostile_values, key):
    """A few hundred bytes of YAML aliases that expand to 9**9 values, under any key: refused at once, in one line
    that quotes a bounded part of the value (under a scalar key it grew to gigabytes and MemoryError)."""
    done = hostile_values[f"bomb-{key}"]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert len(line) < 400 and "expands to more than" in line


def test_a_suite_error_quotes_a_bounded_part_of_a_large_value(hostile_values):
    done = hostile_values["long-value"]
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "unknown executor" in line and len(line) < 400


@pytest.mark.parametrize("name", LONG_NUMBERS)
def test_an_option_value_of_ten_thousand_digits_is_one_short_line(hostile_values, name):
    """No traceback (Python refuses int() of over 4,300 digits) and no 10,000-character line."""
    done = hostile_values[name]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-1500:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and len(line) < 300 and "(10,0" in line


def test_a_case_timeout_in_this_process_is_refused_in_one_line():
    done = _main("run", "--strategies", "baseline", *TINY, "--case-timeout", "5")  # TINY says --no-isolate
    _one_line_exit_2(done, "--case-timeout 5", "--no-isolate")

