"""Rows run as SLURM jobs (Hydra's submitit launcher, `hydra/launcher=slurm`), on the submitting host
(`KvqSlurmLauncher`, hydra_plugins/kvq_lab_launcher). What happens inside a job when SLURM stops it is
kvq_lab.run.slurm_job (the runner imports that one; this module imports the runner).

- `check_resources(params)`: the launcher's settings against the partition (`scontrol show partition`, `scontrol
  show node`): a time over MaxTime, more CPUs or memory than a node has, or a GPU request where no node has one
  fails at once with one line, before anything is submitted.
- `pending_rows(...)`: rows whose completed record exists are skipped there, before any allocation.
- `launch_rows(...)`: the rest as one job array; every row ends in a record and the sweep's summary line.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from kvq_lab.common.errors import ConfigError
from kvq_lab.run.slurm_job import minutes

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
