"""`tune` (and ``keras-tfr tune``): keras-tuner's distributed mode on one machine.

`tune` starts the user's unchanged script as a chief (``KERASTUNER_TUNER_ID=chief``, the
oracle, a gRPC server on ``127.0.0.1``) and N workers (``tuner0``, ``tuner1``, ...) that
ask it for trials, each worker's GPU memory capped through ``KERAS_TFR_GPU_MEMORY_MB``
(read by `keras_tfr.limit_gpu_memory`; it replaces a ``KERAS_TFR_GPU_MEMORY_FRACTION`` of
the environment, which ``import keras_tfr`` would refuse beside it), waits, and reads the
results (best hyperparameters, trials completed) from the shared project directory. The
processes are run by `keras_tfr._supervise`; keras-tuner is patched in them by
`keras_tfr._compat.tuner`.

How keras-tuner's distributed mode behaves (keras-tuner 1.4, read from its source), and
what the launcher does about it:

* the mode is chosen by ``KERASTUNER_ORACLE_IP`` (+ ``_PORT`` and ``KERASTUNER_TUNER_ID``);
  a tuner id containing ``"chief"`` makes ``search()`` serve the oracle and block;
* a worker ends its ``search()`` when the oracle answers ``STOPPED`` (``max_trials``
  reached or the space is exhausted). The chief then waits until no trial is running and
  every worker that asked for trials has been told to stop; it checks that every 20 s,
  which the launcher's child bootstrap shortens to 0.5 s;
* a worker that dies in a trial leaves that trial "ongoing" for ever, and workers whose
  chief died wait up to an hour for it (gRPC ``wait_for_ready``). So the launcher stops
  the chief shortly after the last worker when a worker failed, and stops the workers at
  once when the chief failed;
* ``overwrite=True`` makes every process delete the project directory when its tuner is
  built, so a late worker could delete trials of the others: the bootstrap keeps
  ``overwrite`` for the chief only;
* the oracle's state (``oracle.json``, ``trial_*/trial.json``) is saved by the chief
  after every trial, so the launcher reads the results from those files. The objective's
  direction is not in them; the bootstrap reports it when the chief's tuner is built;
* the chief serves on ``KERASTUNER_ORACLE_PORT`` and the workers connect to it, so the
  port must be known before any process starts. A port the launcher picks and lets go
  could be taken before the chief binds it, by another program or by a second `tune` on
  the same machine (gRPC servers share a port they both bind: ``SO_REUSEPORT``). Without
  ``port=``, the bootstrap has the chief's gRPC server bind a port the system picks, in
  the same call, and write it to a file; each worker's gRPC channel to the oracle waits
  for that file and connects there (`_port_handoff`, through gRPC's public
  ``grpc.server`` and ``grpc.insecure_channel``).

"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from keras_tfr._supervise import Child, Guard, LogFile, stop_all
from keras_tfr.parallel import _set_gpu_memory_env
from keras_tfr.tuner.hypermodel import _check_batch_size

__all__ = ["TuneResult", "is_chief", "is_worker", "tune"]

log = logging.getLogger("keras_tfr")

_REPORT_ENV = "KERAS_TFR_TUNE_REPORT_DIR"
_PORT_FILE_ENV = "KERAS_TFR_TUNE_PORT_FILE"
_PORT_POLL_S = 0.05
_KILL_GRACE_S = 5.0


# --------------------------------------------------------------------------- roles


def is_chief() -> bool:
    """True in the chief process of a distributed keras-tuner search.

    Code that should run once after ``search()`` (printing results, saving the best
    model) belongs on the chief: a worker's ``tuner.get_best_models()`` asks the chief,
    which exits once the search is over, and would wait for it for up to an hour.

    Example:
        >>> tuner.search(train, validation_data=val, epochs=5)
        >>> if not is_worker():       # the chief, or a plain one-process run
        ...     print(tuner.get_best_hyperparameters()[0].values)
    """
    return "KERASTUNER_ORACLE_IP" in os.environ and "chief" in os.environ.get(
        "KERASTUNER_TUNER_ID", ""
    )


def is_worker() -> bool:
    """True in a worker process of a distributed keras-tuner search (see `is_chief`).

    Example:
        >>> if is_worker():          # the chief writes the data set; workers wait for it
        ...     wait_for_data("data/train")
        ... else:
        ...     write_data("data/train")
    """
    return "KERASTUNER_ORACLE_IP" in os.environ and not is_chief()


# --------------------------------------------------------------------------- launcher


@dataclasses.dataclass
class TuneResult:
    """What a distributed search left behind.

    Attributes:
        returncode: 0 when at least one trial completed and every process exited with
            status 0, except workers stopped because they still ran ``worker_grace``
            seconds after the chief ended well (warned about; their signal is in
            ``returncodes``); else 1.
        project_dir: the tuner's shared project directory (None if no tuner was built).
        objective: the objective's name; ``direction`` is ``"min"`` or ``"max"``.
        best_hyperparameters: the best completed trial's values (None without one).
        best_score: its objective value.
        trials: per trial ``{"trial_id", "status", "score", "hyperparameters"}``,
            in trial id order.
        returncodes: exit status per process (``"chief"``, ``"tuner0"``, ...).
        errors: what went wrong, one line each.
        log_dir: the processes' output, ``<tuner id>.log`` each.

    Example:
        >>> result = tune("search.py", workers=2, gpu_memory_mb=1024)
        >>> if not result.ok:
        ...     print(result.errors, result.log_dir)
        >>> result.trials_completed, result.best_score, result.best_hyperparameters
    """

    returncode: int
    project_dir: str | None
    objective: str | None
    direction: str | None
    best_hyperparameters: dict[str, Any] | None
    best_score: float | None
    trials: list[dict[str, Any]]
    returncodes: dict[str, int | None]
    errors: list[str]
    log_dir: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def trials_completed(self) -> int:
        return sum(t["status"] == "COMPLETED" for t in self.trials)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "trials_completed": self.trials_completed}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tune(
    script: str | os.PathLike,
    script_args: Sequence[str] = (),
    *,
    workers: int = 2,
    gpu_memory_mb: int | None = None,
    gpus: Sequence[str] | None = None,
    port: int | None = None,
    timeout: float | None = None,
    worker_grace: float = 30.0,
    log_dir: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    verbose: bool = True,
) -> TuneResult:
    """Runs a keras-tuner script as a chief and ``workers`` workers on this machine.

    The script is a plain keras-tuner script (build a tuner, call ``search``); it runs
    unchanged in every process, and keras-tuner's distributed mode, chosen by the
    environment this function sets, shares out the trials: the chief holds the oracle
    and serves it on ``127.0.0.1:port``, each worker asks it for a trial, runs it and
    reports back. All processes share the working directory, hence the tuner's project
    directory.

    Each worker gets ``KERAS_TFR_GPU_MEMORY_MB=gpu_memory_mb`` (`limit_gpu_memory`
    reads it; the CUDA context comes on top of the cap; a
    ``KERAS_TFR_GPU_MEMORY_FRACTION`` of the environment is removed) and, with ``gpus``, one GPU of
    the list in turn through ``CUDA_VISIBLE_DEVICES``. The chief only runs the oracle
    and builds each model once to learn the search space, so it sees no GPU
    (``CUDA_VISIBLE_DEVICES=""``) and takes no GPU memory.

    Args:
        script: the Python script to run.
        script_args: its command-line arguments.
        workers: worker processes (trials run at once).
        gpu_memory_mb: GPU memory cap per worker in MB, or None for no cap.
        gpus: GPU ids handed out to the workers round-robin, or None to leave
            ``CUDA_VISIBLE_DEVICES`` as it is.
        port: the oracle's port on 127.0.0.1. By default the chief's server binds a port
            the system picks, and the workers learn it from the chief (two searches at
            once never share a port); ``KERASTUNER_ORACLE_PORT`` then holds a port
            picked up front, which the processes do not use.
        timeout: seconds for the whole search; then every process is stopped.
        worker_grace: seconds a worker may still run after the chief ended well (code
            after ``search()`` on a worker that asks the finished chief would wait for an
            hour); then it is stopped, with a warning. The search is over by then, so
            this alone does not make ``returncode`` 1.
        log_dir: where ``chief.log``, ``tuner0.log``, ... go (a new temporary
            directory by default).
        cwd: working directory of the processes (default: the current one).
        env: extra environment variables for every process.
        verbose: copy the processes' output to stdout, each line prefixed with
            ``[tuner id]``.

    Returns:
        A `TuneResult`: ``returncode`` 0 when all went well (see `TuneResult`), the best
        hyperparameters, the trials and where the logs are.

    Example:
        >>> result = tune("search.py", workers=4, gpu_memory_mb=2048, timeout=3600)
        >>> result.ok, result.trials_completed, result.best_hyperparameters
        (True, 20, {'units': 64, 'batch_size': 256})
    """
    chief_picks_port = port is None
    script, workers, gpu_memory_mb, gpus, port = _check_tune_args(
        script, workers, gpu_memory_mb, gpus, port, timeout
    )
    if (
        isinstance(worker_grace, bool)
        or not isinstance(worker_grace, int | float)
        or not worker_grace >= 0
    ):
        raise ValueError(f"Expected `worker_grace` to be seconds >= 0. Received: {worker_grace!r}")
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    log_dir = os.fspath(log_dir) if log_dir else tempfile.mkdtemp(prefix="keras-tfr-tune-")
    os.makedirs(log_dir, exist_ok=True)
    report_dir = tempfile.mkdtemp(prefix="keras-tfr-tune-report-")
    # Removed however this ends (Ctrl-C and SIGTERM included): only a SIGKILL leaves it.
    try:
        base_env = {**os.environ, **(env or {})}
        base_env.update(
            KERASTUNER_ORACLE_IP="127.0.0.1",
            KERASTUNER_ORACLE_PORT=str(port),
            PYTHONUNBUFFERED="1",
            **{_REPORT_ENV: report_dir},
        )
        if chief_picks_port:
            base_env[_PORT_FILE_ENV] = os.path.join(report_dir, "oracle.port")
        base_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        argv = [
            sys.executable,
            "-c",
            "from keras_tfr.tuner.launch import _child_main; _child_main()",
            os.path.abspath(script),
            *map(str, script_args),
        ]
        ids = ["chief"] + [f"tuner{i}" for i in range(workers)]
        children: dict[str, Child] = {}
        logs: dict[str, LogFile] = {}
        errors: list[str] = []
        stopped_after_search: list[str] = []
        start = time.monotonic()
        guard = Guard(_KILL_GRACE_S, "keras-tfr tune")  # stops them if this process is killed
        try:
            for i, tuner_id in enumerate(ids):
                child_env = _child_env(base_env, tuner_id, i, gpu_memory_mb, gpus)
                logs[tuner_id] = LogFile(
                    os.path.join(log_dir, f"{tuner_id}.log"), f"[{tuner_id}] ", verbose
                )
                children[tuner_id] = Child(
                    tuner_id, argv, child_env, sink=logs[tuner_id], cwd=cwd, guard=guard
                )
            log.info(
                "keras-tfr tune: chief and %d worker(s) started, oracle on 127.0.0.1:%s, "
                "logs in %s",
                workers,
                "(a port the chief picks)" if chief_picks_port else port,
                log_dir,
            )
            supervise_errors, stopped_after_search = _supervise(
                children, start, timeout, worker_grace
            )
            errors += supervise_errors
        finally:
            # All at once: SIGTERM to every group, SIGKILL to those left 5 s later.
            stop_all(list(children.values()), signal.SIGTERM, _KILL_GRACE_S)
            guard.close()
            for child in children.values():
                child.join_output(10)

        returncodes = {k: c.poll() for k, c in children.items()}
        for tuner_id, rc in returncodes.items():
            if tuner_id in stopped_after_search:
                continue  # the search was over; warned about in `_supervise`
            if rc not in (0, None) and not any(e.startswith(f"{tuner_id} ") for e in errors):
                errors.append(f"{tuner_id} exited with status {rc}")
        result = _collect(report_dir, returncodes, errors, log_dir)
        for tuner_id in children:
            if returncodes[tuner_id] not in (0, None) and not verbose:
                tail = logs[tuner_id].tail()
                if tail:
                    log.warning("keras-tfr tune: last lines of %s:\n%s", logs[tuner_id].path, tail)
        return result
    finally:
        _remove_tree(report_dir)


def _check_tune_args(
    script: str | os.PathLike,
    workers: Any,
    gpu_memory_mb: Any,
    gpus: Sequence[str] | None,
    port: Any,
    timeout: float | None,
) -> tuple[str, int, int | None, list[str] | None, int]:
    """`tune`'s arguments checked: ``(script, workers, gpu_memory_mb, gpus, port)``."""
    script = os.fspath(script)
    if not os.path.isfile(script):
        raise FileNotFoundError(f"Expected `script` to be a Python file. Received: {script!r}")
    workers = _check_batch_size(workers, "workers")
    if gpu_memory_mb is not None:
        gpu_memory_mb = _check_batch_size(gpu_memory_mb, "gpu_memory_mb")
    gpu_list = None
    if gpus is not None:
        gpu_list = [str(g).strip() for g in gpus]
        if not gpu_list or not all(gpu_list):
            raise ValueError(
                f"Expected `gpus` to list GPU ids like ['0', '1']. Received: {gpu_list!r}"
            )
    if port is None:
        port = _free_port()
    elif not (isinstance(port, int) and 0 < port < 65536):
        raise ValueError(f"Expected `port` to be a TCP port (1-65535). Received: {port!r}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"Expected `timeout` to be positive seconds. Received: {timeout!r}")
    return script, workers, gpu_memory_mb, gpu_list, port


def _child_env(
    base_env: dict[str, str],
    tuner_id: str,
    index: int,
    gpu_memory_mb: int | None,
    gpus: list[str] | None,
) -> dict[str, str]:
    """The environment of process ``index`` (0 is the chief, which sees no GPU).

    ``gpu_memory_mb`` replaces a ``KERAS_TFR_GPU_MEMORY_FRACTION`` the environment holds
    (``import keras_tfr`` refuses both); the chief gets neither variable.
    """
    child_env = {**base_env, "KERASTUNER_TUNER_ID": tuner_id}
    if tuner_id == "chief":
        child_env["CUDA_VISIBLE_DEVICES"] = ""
        _set_gpu_memory_env(child_env)  # no cap: it has no GPU
    else:
        if gpu_memory_mb is not None:
            _set_gpu_memory_env(child_env, megabytes=gpu_memory_mb)
        if gpus is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = gpus[(index - 1) % len(gpus)]
    return child_env


def _supervise(
    children: dict[str, Child], start: float, timeout: float | None, worker_grace: float
) -> tuple[list[str], list[str]]:
    """Waits for the search to end; stops what would hang.

    Returns:
        The errors, and the workers stopped because they outlived a finished search.
    """
    chief = children["chief"]
    workers = {k: c for k, c in children.items() if k != "chief"}
    chief_done_at: float | None = None
    workers_done_at: float | None = None
    while True:
        now = time.monotonic()
        if timeout is not None and now - start > timeout:
            running = [k for k, c in children.items() if c.poll() is None]
            return [f"timed out after {timeout:g} s; stopped {', '.join(running)}"], []
        chief_rc = chief.poll()
        worker_rcs = {k: c.poll() for k, c in workers.items()}
        if chief_rc is not None and chief_rc != 0:
            # Workers would wait up to an hour for a chief that is gone.
            running = [k for k, rc in worker_rcs.items() if rc is None]
            if running:
                log.warning("keras-tfr tune: the chief failed; stopping %s", ", ".join(running))
            return [f"chief exited with status {chief_rc}"], []
        if all(rc is not None for rc in worker_rcs.values()):
            failed = {k: rc for k, rc in worker_rcs.items() if rc != 0}
            if chief_rc is not None:
                return [], []
            if failed:
                # A worker that died in a trial leaves it "ongoing": the chief would wait
                # for it for ever. Give it a moment, then stop it.
                workers_done_at = workers_done_at or now
                if now - workers_done_at > _KILL_GRACE_S:
                    log.warning("keras-tfr tune: a worker failed; stopping the chief")
                    return [], []
        if chief_rc == 0:
            chief_done_at = chief_done_at or now
            running = [k for k, rc in worker_rcs.items() if rc is None]
            if running and now - chief_done_at > worker_grace:
                log.warning(
                    "keras-tfr tune: %s still running %g s after the search ended; stopping "
                    "it. Code after search() that asks the tuner (get_best_models, "
                    "results_summary) should run only where keras_tfr.tuner.is_worker() "
                    "is False.",
                    ", ".join(running),
                    worker_grace,
                )
                stop_all([workers[k] for k in running], signal.SIGTERM, _KILL_GRACE_S)
                return [], running
        time.sleep(0.2)


def _collect(
    report_dir: str, returncodes: dict[str, int | None], errors: list[str], log_dir: str
) -> TuneResult:
    reports = {}
    for path in sorted(glob.glob(os.path.join(report_dir, "*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                reports[os.path.basename(path)[:-5]] = json.load(f)
        except (OSError, ValueError):
            continue
    report = reports.get("chief") or next(iter(reports.values()), None)
    project_dir = objective = direction = None
    trials: list[dict[str, Any]] = []
    if report is None:
        errors.append(
            "no keras-tuner tuner was built: the script must build a tuner and call "
            "search() (see the logs)"
        )
    else:
        project_dir = report["project_dir"]
        objective = report.get("objective")
        direction = report.get("direction")
        trials = _read_trials(project_dir)
    completed = [t for t in trials if t["status"] == "COMPLETED" and t["score"] is not None]
    best = None
    if completed:
        sign = -1.0 if direction == "max" else 1.0
        best = min(completed, key=lambda t: sign * t["score"])
    elif report is not None:
        errors.append(f"no trial completed in {project_dir}")
    returncode = 1 if errors else 0
    return TuneResult(
        returncode=returncode,
        project_dir=project_dir,
        objective=objective,
        direction=direction,
        best_hyperparameters=None if best is None else best["hyperparameters"],
        best_score=None if best is None else best["score"],
        trials=trials,
        returncodes=returncodes,
        errors=errors,
        log_dir=log_dir,
    )


def _read_trials(project_dir: str) -> list[dict[str, Any]]:
    trials = []
    for path in glob.glob(os.path.join(glob.escape(project_dir), "trial_*", "trial.json")):
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            log.warning("keras-tfr tune: cannot read %s: %s", path, e)
            continue
        score = state.get("score")
        trials.append(
            {
                "trial_id": state.get("trial_id"),
                "status": state.get("status"),
                "score": None if score is None or not math.isfinite(score) else float(score),
                "hyperparameters": dict(state.get("hyperparameters", {}).get("values", {})),
            }
        )
    return sorted(trials, key=lambda t: str(t["trial_id"]))


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- child side


def _write_report(tuner: Any) -> None:
    report_dir = os.environ.get(_REPORT_ENV)
    if not report_dir:
        return
    oracle = getattr(tuner, "oracle", None)
    objective = getattr(oracle, "objective", None)
    if objective is None and oracle is not None and hasattr(oracle, "_oracle"):
        objective = getattr(oracle._oracle, "objective", None)
    report = {
        "tuner_id": os.environ.get("KERASTUNER_TUNER_ID"),
        "pid": os.getpid(),
        "project_dir": os.path.abspath(tuner.project_dir),
        "objective": getattr(objective, "name", None),
        "direction": getattr(objective, "direction", None),
    }
    path = os.path.join(report_dir, f"{report['tuner_id']}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def _port_handoff(chief: bool) -> None:
    """Without ``tune(port=...)``: the chief's gRPC server binds a port the system picks
    and writes it to the file ``KERAS_TFR_TUNE_PORT_FILE`` names; a worker's gRPC channel
    to the oracle waits for that file and connects to that port. Both replace only the
    oracle's address (``KERASTUNER_ORACLE_IP:KERASTUNER_ORACLE_PORT``), so other gRPC
    servers and channels of the script are left alone."""
    port_file = os.environ.get(_PORT_FILE_ENV)
    ip = os.environ.get("KERASTUNER_ORACLE_IP")
    port = os.environ.get("KERASTUNER_ORACLE_PORT")
    if not (port_file and ip and port):
        return
    import grpc  # a requirement of keras-tuner

    oracle = f"{ip}:{port}"
    if chief:
        make_server = grpc.server

        def server(*args: Any, **kwargs: Any) -> Any:
            srv = make_server(*args, **kwargs)
            add_port = srv.add_insecure_port

            def add_insecure_port(address: str) -> int:
                if address != oracle:
                    return int(add_port(address))
                bound = int(add_port(f"{ip}:0"))
                if bound:  # older grpc returned 0 on failure; newer raises RuntimeError
                    with open(port_file + ".tmp", "w", encoding="utf-8") as f:
                        f.write(str(bound))
                    os.replace(port_file + ".tmp", port_file)
                return bound

            srv.add_insecure_port = add_insecure_port
            return srv

        grpc.server = server
    else:
        open_channel = grpc.insecure_channel

        def insecure_channel(target: str, *args: Any, **kwargs: Any) -> Any:
            if target == oracle:
                target = f"{ip}:{_wait_for_port(port_file)}"
            return open_channel(target, *args, **kwargs)

        grpc.insecure_channel = insecure_channel


def _wait_for_port(port_file: str) -> int:
    """The port the chief wrote to ``port_file``, once it has (the launcher stops this
    worker if the chief fails or the search times out)."""
    while True:
        try:
            with open(port_file, encoding="utf-8") as f:
                return int(f.read())
        except FileNotFoundError:
            time.sleep(_PORT_POLL_S)


def _child_main() -> None:
    """Entry point of each process started by `tune`: runs the user's script."""
    import runpy

    if len(sys.argv) < 2:
        raise SystemExit("usage: _child_main SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    from keras_tfr._compat import tuner as compat_tuner  # keras-tuner has no public hooks

    compat_tuner.install_child_patches(is_worker, _write_report)
    _port_handoff(chief=is_chief())
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
