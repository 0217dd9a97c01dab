"""`keras-tfr parallel` / `keras_tfr.parallel.launch` with small CPU jobs (no TensorFlow)."""

from __future__ import annotations

import glob
import io
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _procs import running, start_and_wait, still_running

from keras_tfr import cli
from keras_tfr.parallel import launch

pytestmark = pytest.mark.subprocess

PY = sys.executable


def _py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def _lines_by_child(text: str) -> dict[int, list[str]]:
    by_child: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\[(\d+)\] (.*)", line)
        assert m, f"line without a prefix: {line!r}"
        by_child.setdefault(int(m.group(1)), []).append(m.group(2))
    return by_child


_PRINTER = """
import sys
i, n = int(sys.argv[1]), int(sys.argv[2])
for k in range(5):
    print(f"line {k} of child {i}/{n}")
print("on stderr", i, file=sys.stderr)
"""


def test_all_succeed_prefixes_and_substitution():
    out = io.StringIO()
    code = launch(
        [*_py(_PRINTER), "{i}", "{n}"],
        3,
        output=out,
    )
    assert code == 0
    by_child = _lines_by_child(out.getvalue())
    assert sorted(by_child) == [0, 1, 2]
    for i, lines in by_child.items():
        # Each child's lines arrive whole and in its own order, stderr included.
        assert [x for x in lines if x.startswith("line")] == [
            f"line {k} of child {i}/3" for k in range(5)
        ]
        assert f"on stderr {i}" in lines
        assert len(lines) == 6


def test_exit_code_is_one_when_any_child_fails():
    out = io.StringIO()
    code = launch(
        [*_py("import sys; print('x'); sys.exit(5 if sys.argv[1] == '1' else 0)"), "{i}"],
        3,
        output=out,
    )
    assert code == 1
    assert sorted(_lines_by_child(out.getvalue())) == [0, 1, 2]


def test_last_line_without_newline_and_bytes_that_are_not_utf8():
    out = io.StringIO()
    code = launch(
        _py("import sys; sys.stdout.buffer.write(b'a\\xffb\\nno newline'); sys.stdout.flush()"),
        1,
        output=out,
    )
    assert code == 0
    assert out.getvalue() == "[0] a\ufffdb\n[0] no newline\n"


def test_environment_of_each_child():
    out = io.StringIO()
    show = _py(
        """
        import os
        keys = ["KERAS_TFR_PARALLEL_INDEX", "KERAS_TFR_PARALLEL_COUNT",
                "KERAS_TFR_GPU_MEMORY_MB", "KERAS_TFR_GPU_MEMORY_FRACTION", "EXTRA"]
        print(" ".join(f"{k}={os.environ.get(k)}" for k in keys))
        """
    )
    os.environ["KERAS_TFR_GPU_MEMORY_FRACTION"] = "0.9"  # the launcher's own: replaced
    try:
        assert launch(show, 2, gpu_memory_mb=1536, env={"EXTRA": "yes"}, output=out) == 0
    finally:
        del os.environ["KERAS_TFR_GPU_MEMORY_FRACTION"]
    by_child = _lines_by_child(out.getvalue())
    for i in (0, 1):
        assert by_child[i] == [
            f"KERAS_TFR_PARALLEL_INDEX={i} KERAS_TFR_PARALLEL_COUNT=2 "
            "KERAS_TFR_GPU_MEMORY_MB=1536 KERAS_TFR_GPU_MEMORY_FRACTION=None EXTRA=yes"
        ]
    out = io.StringIO()
    assert launch(show, 1, gpu_memory_fraction=0.25, output=out) == 0
    assert "KERAS_TFR_GPU_MEMORY_MB=None KERAS_TFR_GPU_MEMORY_FRACTION=0.25" in out.getvalue()


def test_set_gpu_memory_env_keeps_one_variable():
    """Shared by `keras-tfr parallel` and `keras-tfr tune`: `import keras_tfr` refuses both."""
    from keras_tfr.parallel import _set_gpu_memory_env

    mb, fraction = "KERAS_TFR_GPU_MEMORY_MB", "KERAS_TFR_GPU_MEMORY_FRACTION"
    env = {"PATH": "/bin", fraction: "0.9"}
    _set_gpu_memory_env(env, megabytes=512)
    assert env == {"PATH": "/bin", mb: "512"}
    _set_gpu_memory_env(env, fraction=0.25)
    assert env == {"PATH": "/bin", fraction: "0.25"}
    _set_gpu_memory_env(env)
    assert env == {"PATH": "/bin"}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"command": [], "n": 2}, ValueError, "command"),
        ({"command": "python x.py", "n": 2}, ValueError, "command"),
        ({"command": [PY, 3], "n": 2}, TypeError, "strings"),
        ({"command": [PY], "n": 0}, ValueError, "`n`"),
        ({"command": [PY], "n": True}, ValueError, "`n`"),
        ({"command": [PY], "n": 1, "gpu_memory_mb": 0}, ValueError, "gpu_memory_mb"),
        ({"command": [PY], "n": 1, "gpu_memory_mb": 1.5}, TypeError, "gpu_memory_mb"),
        ({"command": [PY], "n": 1, "gpu_memory_fraction": 1.5}, ValueError, "fraction"),
        (
            {"command": [PY], "n": 1, "gpu_memory_mb": 10, "gpu_memory_fraction": 0.5},
            ValueError,
            "only one",
        ),
        ({"command": [PY], "n": 1, "grace_period": -1}, ValueError, "grace_period"),
    ],
)
def test_argument_checking(kwargs, error, match):
    command = kwargs.pop("command")
    n = kwargs.pop("n")
    with pytest.raises(error, match=match):
        launch(command, n, **kwargs)


def test_missing_program_raises_and_leaves_nothing_running(tmp_path):
    # Child 0's program exists and would run for a minute; child 1's does not exist.
    program = tmp_path / "prog-0"
    program.write_text(f"#!{PY}\nimport time\ntime.sleep(60)\n")
    program.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError):
        launch([str(tmp_path / "prog-{i}")], 2, grace_period=20, output=io.StringIO())
    assert time.monotonic() - start < 20  # child 0 stopped at SIGTERM, not killed later
    left = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                if str(program).encode() in f.read():
                    left.append(cmdline)
        except OSError:
            pass
    assert left == []


def test_fail_fast_stops_the_others(caplog):
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="keras_tfr.parallel"):
        code = launch(
            [*_py("import sys, time\nif sys.argv[1] == '0': sys.exit(4)\ntime.sleep(60)"), "{i}"],
            3,
            fail_fast=True,
            grace_period=30,
            output=io.StringIO(),
        )
    assert code == 1
    assert time.monotonic() - start < 30  # the sleepers were stopped, not waited for
    messages = [r.getMessage() for r in caplog.records]
    assert "keras-tfr parallel: [0] exited with code 4" in messages
    assert "keras-tfr parallel: [1] was stopped by SIGTERM" in messages
    assert "keras-tfr parallel: [2] was stopped by SIGTERM" in messages


def test_without_fail_fast_the_others_finish(caplog):
    with caplog.at_level(logging.INFO, logger="keras_tfr.parallel"):
        code = launch(
            [*_py("import sys, time\nif sys.argv[1] == '0': sys.exit(4)\ntime.sleep(1)"), "{i}"],
            2,
            output=io.StringIO(),
        )
    assert code == 1
    messages = [r.getMessage() for r in caplog.records]
    assert "keras-tfr parallel: [0] exited with code 4" in messages
    assert not any(m.startswith("keras-tfr parallel: [1]") for m in messages)  # it succeeded


# -- signals: the launcher runs in its own process, as from a terminal -------------------

_CHILD = """
import os, signal, sys, time, pathlib
here = pathlib.Path(sys.argv[1])
if sys.argv[3] in ("ignore", "grandchild"):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[3] == "grandchild":  # a process of its own that ignores the signals too
    import subprocess
    grand = subprocess.Popen([sys.executable, "-c", "import signal, time; "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
    (here / f"grandchild-{sys.argv[2]}").write_text(str(grand.pid))
try:  # from "ready" on: the test signals once every pid file is there
    print("ready", flush=True)
    # Written whole, then renamed: the test polls for the file and must not read it empty.
    (here / f"tmp-{sys.argv[2]}").write_text(str(os.getpid()))
    os.replace(here / f"tmp-{sys.argv[2]}", here / f"pid-{sys.argv[2]}")
    time.sleep(120)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
"""


def _start_launcher(tmp_path, n, behaviour="normal", grace="10"):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    cmd = [PY, "-m", "keras_tfr.cli", "parallel", "-n", str(n), "--grace-period", grace, "--"]
    cmd += [PY, str(script), str(tmp_path), "{i}", behaviour]
    proc, pids = start_and_wait(cmd, tmp_path, n)
    return proc, [pids[str(i)] for i in range(n)]


def test_ctrl_c_stops_every_child(tmp_path):
    proc, pids = _start_launcher(tmp_path, 3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    by_child = _lines_by_child(out)
    for i in range(3):
        # Each child got the SIGINT itself (KeyboardInterrupt), so it could clean up.
        assert by_child[i] == ["ready", "interrupted"]
        assert f"[{i}] exited with code 3" in err
    assert "SIGINT received" in err
    assert not any(running(p) for p in pids)


def test_sigterm_stops_every_child(tmp_path):
    proc, pids = _start_launcher(tmp_path, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert "[0] was stopped by SIGTERM" in err and "[1] was stopped by SIGTERM" in err
    assert not any(running(p) for p in pids)


def test_children_that_ignore_the_signal_are_killed_after_the_grace_period(tmp_path):
    proc, pids = _start_launcher(tmp_path, 2, behaviour="ignore", grace="0.5")
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert time.monotonic() - start < 30
    assert "did not stop; killing it" in err
    assert "[0] was stopped by SIGKILL" in err
    assert not any(running(p) for p in pids)


def test_a_second_ctrl_c_kills_at_once(tmp_path):
    """docs/gpu.md: children still running at a second Ctrl-C are killed, without waiting
    for the grace period."""
    proc, pids = _start_launcher(tmp_path, 2, behaviour="ignore", grace="60")
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    # The second Ctrl-C once the launcher has taken the first (two signals close
    # together could reach its handler as one).
    said = ""
    while "SIGINT received" not in said:
        line = proc.stderr.readline()
        assert line, "the launcher ended before the second Ctrl-C"
        said += line
    assert proc.poll() is None, "still waiting for the children"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert time.monotonic() - start < 30, "the second Ctrl-C did not cut the 60 s grace"
    assert "[0] was stopped by SIGKILL" in err and "[1] was stopped by SIGKILL" in err
    assert not any(running(p) for p in pids)


def test_children_are_killed_with_their_own_child_processes(tmp_path):
    """docs/gpu.md: a child killed after the grace period goes with its own children."""
    proc, pids = _start_launcher(tmp_path, 2, behaviour="grandchild", grace="0.5")
    grand = [int((tmp_path / f"grandchild-{i}").read_text()) for i in range(2)]
    assert all(running(g) for g in grand)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    deadline = time.monotonic() + 10
    while any(running(g) for g in grand + pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(g) for g in grand + pids), "a grandchild outlived the launcher"


@pytest.mark.parametrize("behaviour", ["normal", "grandchild"])
def test_children_end_when_the_launcher_is_killed(tmp_path, behaviour):
    """SIGKILL to the launcher (which it cannot catch) still stops every child, in
    groups of their own: SIGTERM, then SIGKILL after the grace period for those that
    ignore it, with their own children."""
    proc, pids = _start_launcher(tmp_path, 2, behaviour=behaviour, grace="0.5")
    grand = []
    if behaviour == "grandchild":
        grand = [int((tmp_path / f"grandchild-{i}").read_text()) for i in range(2)]
    proc.kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert still_running(pids + grand, 20) == [], "a process outlived the killed launcher"
    assert (
        "keras-tfr parallel: the launcher ended without stopping its 2 process(es); "
        "stopping them (SIGTERM, then SIGKILL after 0.5 s)"
    ) in err


def test_launcher_that_ends_normally_leaves_no_guard(tmp_path):
    """The guard of each `launch` ends with it (a notebook may call it many times)."""
    code = launch(_py("print('hi')"), 2, output=io.StringIO(), grace_period=30)
    assert code == 0
    ours = subprocess.run(
        ["ps", "-o", "pid=,stat=,args=", "--ppid", str(os.getpid())],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "killpg" not in ours, ours  # no guard left, not even a zombie


# -- the subcommand ----------------------------------------------------------------------


def test_cli_runs_and_returns_the_exit_code(capsys):
    code = cli.main(
        [
            "parallel",
            "-n",
            "2",
            "--gpu-memory-mb",
            "64",
            "--",
            *_py(
                "import os, sys; print(os.environ['KERAS_TFR_GPU_MEMORY_MB'], sys.argv[1]); "
                "sys.exit(int(sys.argv[1]))"
            ),
            "{i}",
        ]
    )
    assert code == 1
    by_child = _lines_by_child(capsys.readouterr().out)
    assert by_child == {0: ["64 0"], 1: ["64 1"]}


def test_cli_usage_errors(capsys):
    assert cli.main(["parallel", "-n", "2"]) == 2
    assert "expected a command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(
            [
                "parallel",
                "-n",
                "2",
                "--gpu-memory-mb",
                "1",
                "--gpu-memory-fraction",
                "0.5",
                "--",
                PY,
            ]
        )
    assert e.value.code == 2


def test_cli_fail_fast_stops_the_others(caplog):
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="keras_tfr.parallel"):
        code = cli.main(
            [
                *["parallel", "-n", "3", "--fail-fast", "--grace-period", "30", "--"],
                *_py("import sys, time\nif sys.argv[1] == '0': sys.exit(4)\ntime.sleep(60)"),
                "{i}",
            ]
        )
    assert code == 1
    assert time.monotonic() - start < 30  # the sleepers were stopped, not waited for
    messages = [r.getMessage() for r in caplog.records]
    assert "keras-tfr parallel: a process failed; stopping the others" in messages
    assert "keras-tfr parallel: [1] was stopped by SIGTERM" in messages
    assert "keras-tfr parallel: [2] was stopped by SIGTERM" in messages


def test_cli_gpu_memory_fraction_replaces_the_shells_mb(capsys, monkeypatch):
    monkeypatch.setenv("KERAS_TFR_GPU_MEMORY_MB", "2048")  # exported by the user's shell
    show = (
        "import os; import keras_tfr; "  # applies the cap; raises with both variables
        "print('cap', os.environ.get('KERAS_TFR_GPU_MEMORY_MB'), "
        "os.environ['KERAS_TFR_GPU_MEMORY_FRACTION'])"
    )
    code = cli.main(["parallel", "-n", "1", "--gpu-memory-fraction", "0.2", "--", PY, "-c", show])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[0] cap None 0.2" in out.splitlines()


def _gpu_doc() -> str:
    from pathlib import Path

    return (Path(__file__).parent.parent / "docs" / "gpu.md").read_text()


def test_cli_grace_period_default_is_the_documented_one():
    import inspect

    from keras_tfr.cli import build_parser

    documented = re.search(r"`--grace-period` seconds \(default (\d+)\)", _gpu_doc())
    assert documented, "docs/gpu.md no longer states the --grace-period default"
    default = float(documented.group(1))
    args = build_parser().parse_args(["parallel", "-n", "1", "--", PY])
    assert args.grace_period == default
    assert inspect.signature(launch).parameters["grace_period"].default == default
    r = subprocess.run(
        [PY, "-m", "keras_tfr.cli", "parallel", "--help"], capture_output=True, text=True
    )
    assert f"(default {documented.group(1)})" in " ".join(r.stdout.split())


def test_cli_ends_with_the_documented_summary_line():
    documented = re.search(r"^keras-tfr parallel: all 4 process\(es\) succeeded$", _gpu_doc(), re.M)
    assert documented, "docs/gpu.md no longer shows the closing line"
    r = subprocess.run(
        [PY, "-m", "keras_tfr.cli", "parallel", "-n", "2", "--", PY, "-c", "print('hi')"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert _lines_by_child(r.stdout) == {0: ["hi"], 1: ["hi"]}
    assert r.stderr.splitlines()[-1] == "keras-tfr parallel: all 2 process(es) succeeded"
