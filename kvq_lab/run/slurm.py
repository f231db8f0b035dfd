"""Rows run as SLURM jobs (Hydra's submitit launcher, `hydra/launcher=slurm`): how a row that SLURM stops ends, and
what the submitting host checks before it asks for an allocation.

In the job (`submitit.core._submit`):
- `stop_reason(signame)`: why SLURM stopped the row, for its record: `time limit` (submitit's warning signal, SIGUSR2,
  sent `signal_delay_s` before the limit, or SLURM's own SIGTERM at the limit), `preempted` (SIGUSR2 at another time,
  or SIGTERM with the job going back to the queue), `cancelled` (scancel), else empty.
- `end_interrupted(e)`: after the row's record says `interrupted`: on submitit's signal, submitit requeues the job
  (the launcher's checkpoint resubmits the row, which then runs again from its start: rows keep no mid-row state)
  while its timeout budget (`max_num_timeout`) lasts; a job that will not come back returns normally, so that
  submitit writes a result file and the submitting host sees the row end (and does not wait on sacct for ever);
  a job that SLURM itself requeues exits without one, and the host waits for the rerun.

On the submitting host (`KvqSlurmLauncher`, hydra_plugins/kvq_lab_launcher):
- `check_resources(params)`: the launcher's settings against the partition (`scontrol show partition`, `scontrol
  show node`): a time over MaxTime, more CPUs or memory than a node has, or a GPU request where no node has one
  fails at once with one line, before anything is submitted.
- `pending_rows(...)`: rows whose completed record exists are skipped there, before any allocation.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from kvq_lab.common.errors import ConfigError

PREEMPT_ENV = "SUBMITIT_PREEMPT_SIGNAL"  # submitit's name for its preemption/timeout signal (default USR2)
TIME_LIMIT_MARGIN_S = 60  # a warning signal this close (plus signal_delay_s) to the job's end time is the time limit


def in_submitit_job() -> bool:
    """True inside a job that submitit started (SLURM or its local executor)."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def in_slurm_job() -> bool:
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and bool(os.environ.get("SLURM_JOB_ID"))


def preempt_signal() -> signal.Signals | None:
    """The signal submitit turns into checkpoint + requeue in this job (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says
    otherwise); None outside a submitit job."""
    if not in_submitit_job():
        return None
    return getattr(signal, "SIG" + os.environ.get(PREEMPT_ENV, "USR2"), None)


def _scontrol_job(job_id: str) -> dict[str, str]:
    """`scontrol show job -o <id>` as key -> value (empty when scontrol is missing or fails)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "show", "job", "-o", job_id], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}


def _seconds_left(job: dict[str, str]) -> float | None:
    """Seconds until the job's time limit: its StartTime plus its TimeLimit, less now (scontrol's EndTime will not
    do: a cancelled job's EndTime is the moment of the cancel). None when SLURM does not say."""
    limit = minutes(job.get("TimeLimit", ""))
    try:
        start = time.mktime(time.strptime(job.get("StartTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
    return None if limit is None else start + limit * 60 - time.time()


def _signal_delay_s() -> float:
    """submitit's `signal_delay_s` as sbatch got it (SLURM exports nothing for it: 120 is submitit's default)."""
    return float(os.environ.get("KVQ_SIGNAL_DELAY_S", "120"))


def _requeued(job: dict[str, str]) -> bool:
    """SLURM is putting this job back in the queue (preemption with requeue, `scontrol requeue`): its restart count
    has grown past the one this run started with (SLURM_RESTART_COUNT; the job's state is COMPLETING either way)."""
    now = job.get("Restarts", "")
    return now.isdigit() and int(now) > int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def stop_reason(signame: str) -> str:
    """Why SLURM stopped this row (see the module doc); '' outside a SLURM job or when SLURM cannot tell."""
    if not in_slurm_job():
        return ""
    job = _scontrol_job(os.environ["SLURM_JOB_ID"])
    left = _seconds_left(job)
    pre = preempt_signal()
    if pre is not None and signame == pre.name:
        near_end = left is not None and left <= _signal_delay_s() + TIME_LIMIT_MARGIN_S
        return "time limit" if near_end else "preempted"
    if signame == "SIGTERM" and job:
        if _requeued(job):
            return "preempted"
        if job.get("JobState") == "TIMEOUT" or (left is not None and left <= TIME_LIMIT_MARGIN_S):
            return "time limit"
        return "cancelled"
    return ""


def will_be_requeued() -> bool:
    """SLURM put this job back in the queue (preemption with requeue, `scontrol requeue`): its rerun ends the row."""
    return in_slurm_job() and _requeued(_scontrol_job(os.environ["SLURM_JOB_ID"]))


def end_interrupted(signum: int | None, previous) -> None:
    """In a submitit job, after the interrupted row's record is written: hand submitit's own signal to its handler
    (`previous`: checkpoint + requeue, then SystemExit) while its timeout budget lasts; return normally when the job
    will not come back (submitit then writes a result file); exit without one when SLURM requeues the job itself."""
    import sys

    pre = preempt_signal()
    if pre is not None and signum == pre and callable(previous):
        try:
            previous(signum, None)  # requeues and exits (SystemExit), or raises when it will not requeue
        except SystemExit:
            raise
        except Exception as e:  # submitit's UncompletedJobError: "timed-out too many times" and the like
            print(f"not requeued: {e}", file=sys.stderr)
        return
    if signum == signal.SIGTERM and will_be_requeued():
        raise SystemExit(128 + signal.SIGTERM)


# ---------------------------------------------------------------------------------------------------------------
# The submitting host: the launcher's settings against the cluster
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    name: str
    max_time_min: float | None  # None = UNLIMITED
    cpus: int  # the most CPUs one of its nodes has
    mem_mb: int  # the most memory one of its nodes has
    gpus: int  # the most GPUs (gres gpu) one of its nodes has


def _run(args: list[str]) -> str:
    exe = shutil.which(args[0])
    if exe is None:
        raise ConfigError(
            f"hydra/launcher=slurm: `{args[0]}` not found on this host; submit from a SLURM login node (or start "
            "one here: scripts/slurm_local.sh start, then export SLURM_CONF as it prints)"
        )
    try:
        out = subprocess.run([exe, *args[1:]], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"hydra/launcher=slurm: `{' '.join(args)}` did not answer in 30 s; is slurmctld up?"
        ) from None
    if out.returncode != 0:
        msg = (out.stderr or out.stdout).strip().splitlines()
        raise ConfigError(f"hydra/launcher=slurm: `{' '.join(args)}` failed: {msg[0] if msg else out.returncode}")
    return out.stdout


def minutes(text: str) -> float | None:
    """SLURM's time format ([days-]hours:minutes:seconds, minutes, minutes:seconds, UNLIMITED) -> minutes."""
    if text in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    days = 0
    if "-" in text:  # days-hours[:minutes[:seconds]]
        d, text = text.split("-", 1)
        days = int(d)
        h, m, sec = ([int(p) for p in text.split(":")] + [0, 0])[:3]
    else:  # minutes, minutes:seconds, hours:minutes:seconds
        parts = [int(p) for p in text.split(":")]
        h, m, sec = (0, parts[0], 0) if len(parts) == 1 else (0, *parts) if len(parts) == 2 else parts
    return days * 1440 + h * 60 + m + sec / 60


def _gpus(gres: str) -> int:
    """Number of GPUs in a node's Gres (`gpu:4`, `gpu:a100:8(S:0-1)`, `(null)`)."""
    n = 0
    for item in gres.split(","):
        f = item.split("(")[0].split(":")
        if f[0] == "gpu" and f[-1].isdigit():
            n += int(f[-1])
    return n


def partition(name: str | None) -> Partition:
    """The partition `name` (None: the cluster's default), read from scontrol."""
    text = _run(["scontrol", "show", "partition", "-o"])
    parts = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in text.splitlines() if line.strip()]
    if not parts:
        raise ConfigError("hydra/launcher=slurm: the cluster has no partition (scontrol show partition is empty)")
    if name is None:
        chosen = next((p for p in parts if p.get("Default") == "YES"), None)
        if chosen is None:
            raise ConfigError(
                "hydra.launcher.partition=null but the cluster has no default partition; "
                f"set hydra.launcher.partition to one of: {', '.join(p['PartitionName'] for p in parts)}"
            )
    else:
        chosen = next((p for p in parts if p.get("PartitionName") == name), None)
        if chosen is None:
            known = ", ".join(p["PartitionName"] for p in parts)
            raise ConfigError(f"hydra.launcher.partition={name!r} does not exist; partitions: {known}")
    nodes_text = _run(["scontrol", "show", "node", "-o", chosen.get("Nodes", "")])
    nodes = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in nodes_text.splitlines() if line.strip()]
    return Partition(
        name=chosen["PartitionName"],
        max_time_min=minutes(chosen.get("MaxTime", "UNLIMITED")),
        cpus=max((int(n.get("CPUTot", 0) or 0) for n in nodes), default=0),
        mem_mb=max((int(n.get("RealMemory", 0) or 0) for n in nodes), default=0),
        gpus=max((_gpus(n.get("Gres", "")) for n in nodes), default=0),
    )


def check_resources(params: dict, part: Partition) -> None:
    """The launcher settings a row asks for against what `part` can give; one-line ConfigError naming the setting
    and the limit."""
    t = params.get("timeout_min")
    if part.max_time_min is not None and t is not None and t > part.max_time_min:
        raise ConfigError(
            f"hydra.launcher.timeout_min={t} exceeds partition {part.name}'s MaxTime of {part.max_time_min:g} "
            f"minutes (the job would stay pending for ever); use hydra.launcher.timeout_min<={part.max_time_min:g}"
        )
    tasks = int(params.get("tasks_per_node") or 1)
    cpus = params.get("cpus_per_task")
    if cpus is not None and part.cpus and cpus * tasks > part.cpus:
        raise ConfigError(
            f"hydra.launcher.cpus_per_task={cpus} (x {tasks} tasks) is more than a node of partition {part.name} has "
            f"({part.cpus} CPUs); use hydra.launcher.cpus_per_task<={part.cpus // tasks}"
        )
    mem = params.get("mem_gb")
    if mem is not None and part.mem_mb and mem * 1024 > part.mem_mb:
        raise ConfigError(
            f"hydra.launcher.mem_gb={mem} is more than a node of partition {part.name} has ({part.mem_mb} MB); "
            f"use hydra.launcher.mem_gb<={part.mem_mb // 1024}"
        )
    gpus = params.get("gpus_per_node") or params.get("gpus_per_task")
    if gpus and gpus > part.gpus:
        have = f"has {part.gpus} GPUs per node" if part.gpus else "has no GPUs (no gres gpu)"
        fix = "hydra/launcher=slurm (CPU rows, device=cpu)" if not part.gpus else f"gpus_per_node<={part.gpus}"
        raise ConfigError(f"hydra.launcher.gpus_per_node={gpus} but partition {part.name} {have}; use {fix}")
    delay = params.get("signal_delay_s")
    if t is not None and delay is not None and delay >= t * 60:
        raise ConfigError(
            f"hydra.launcher.signal_delay_s={delay} is not shorter than timeout_min={t} minutes: the warning signal "
            f"would come before the row starts; use signal_delay_s<{math.floor(t * 60)}"
        )


# ---------------------------------------------------------------------------------------------------------------
# The submitting host: the sweep's rows as a job array
# ---------------------------------------------------------------------------------------------------------------


def pending_rows(config, job_overrides) -> tuple[list[int], dict[int, str]]:
    """Which rows still need a job: (indices to submit, {index: the completed record's path} for those to skip).
    Rows are composed and validated as the jobs will compose them (no model loads)."""
    from kvq_lab.records.record import RECORD
    from kvq_lab.run.config import validate
    from kvq_lab.run.runner import completed_record
    from kvq_lab.run.sweep import note, row_config

    submit, skip = [], {}
    for i, overrides in enumerate(job_overrides):
        plan = validate(row_config(config, list(overrides)))
        done, _ = completed_record(plan)
        if done is None:
            submit.append(i)
        else:
            skip[i] = f"{done['_path']}/{RECORD}"
            note(plan.row_key, "skipped", f"a completed record exists ({skip[i]}); not submitted")
    return submit, skip


def _params_for(executor_name: str, params: dict) -> tuple[dict, dict]:
    """Launcher settings -> (AutoExecutor init kwargs, update_parameters kwargs), as the submitit plugin maps them."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    init = {"folder": params["submitit_folder"]}
    if "max_num_timeout" in params:
        init[f"{executor_name}_max_num_timeout"] = params["max_num_timeout"]
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    rest = {
        (k if k in shared else f"{executor_name}_{k}"): v
        for k, v in params.items()
        if k not in ("submitit_folder", "max_num_timeout")
    }
    return init, rest


GONE_GRACE_S = 60  # a job out of squeue this long without a result file has ended without one


def _in_queue(job_id: str) -> bool | None:
    """Whether squeue still lists the job (pending, running, completing); None when squeue cannot tell."""
    exe = shutil.which("squeue")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-h", "-j", job_id, "-o", "%i"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else False


def _wait(job, poll_s: float = 2.0) -> bool:
    """Until SLURM is done with the job -> whether submitit saw it finish. squeue decides first: a job it lists
    (pending, requeued, running, completing) is not done whatever sacct said a moment ago (a requeued job shows its
    killed run's states there); one it no longer lists is done once submitit agrees (a result file, or sacct's final
    state), or after GONE_GRACE_S without: a cluster without accounting never gives submitit a final state, and a
    job killed outright never writes a result, and submitit would wait for ever."""
    gone = None
    while True:
        queued = _in_queue(job.job_id)
        if queued:
            gone = None
        elif job.done():
            return True
        elif queued is False:
            gone = gone or time.time()
            if time.time() - gone > GONE_GRACE_S:
                return False
        time.sleep(poll_s)


def launch_rows(launcher, job_overrides, initial_job_idx: int):
    """`KvqSlurmLauncher.launch`: check the settings against the partition, skip completed rows, submit the rest as
    one job array, and wait for every job; each row ends as a completed JobReturn whatever happened to its job (the
    sweep's summary, `kvq_lab.run.sweep.finish`, reads each row's end from its records, and a job that ended
    without a result, killed outright, is noted `died` there)."""
    import sys
    from pathlib import Path

    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobReturn, JobStatus, filter_overrides

    from kvq_lab.run.config import validate
    from kvq_lab.run.sweep import note, row_config

    params = dict(launcher.params)
    try:
        check_resources(params, partition(params.get("partition")))
        submit, skip = pending_rows(launcher.config, job_overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    returns = [JobReturn(overrides=list(o), status=JobStatus.COMPLETED) for o in job_overrides]
    for i, where in skip.items():
        print(f"skip: row {initial_job_idx + i} ({' '.join(filter_overrides(job_overrides[i]))}): {where}")
    if not submit:
        print(f"sweep: all {len(job_overrides)} rows have completed records; nothing submitted", file=sys.stderr)
        return returns
    delay = params.get("signal_delay_s")
    if delay is not None:  # the job's stop_reason needs it; sbatch exports nothing for it
        params["setup"] = [*(params.get("setup") or []), f"export KVQ_SIGNAL_DELAY_S={int(delay)}"]
    init, rest = _params_for("slurm", params)
    executor = submitit.AutoExecutor(cluster="slurm", **init)
    executor.update_parameters(**rest)
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    args = [
        (list(job_overrides[i]), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}")
        for i in submit
    ]
    print(f"submitting {len(submit)} of {len(job_overrides)} rows to SLURM ({len(skip)} completed)", file=sys.stderr)
    jobs = executor.map_array(launcher, *zip(*[(*a, Singleton.get_state()) for a in args], strict=True))
    for i, job in zip(submit, jobs, strict=True):
        plan = validate(row_config(launcher.config, list(job_overrides[i])))
        if not _wait(job):
            note(plan.row_key, "died", f"SLURM job {job.job_id} left the queue without a result")
            continue
        try:
            result = job.results()[0]
            returns[i] = result if isinstance(result, JobReturn) else returns[i]
            if returns[i].status != JobStatus.COMPLETED:  # an error hydra caught in the job: its record says so
                returns[i] = JobReturn(overrides=list(job_overrides[i]), status=JobStatus.COMPLETED)
        except (submitit.core.utils.UncompletedJobError, submitit.core.utils.FailedJobError) as e:
            first = str(e).strip().splitlines()
            note(plan.row_key, "died", f"SLURM job {job.job_id} ended without a result ({first[0] if first else e})")
    return returns
