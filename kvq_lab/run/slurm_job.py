"""Inside a row's SLURM job (submitit's `_submit`, `hydra/launcher=slurm`): why SLURM stopped the row, and how the
job ends after the row's record says `interrupted`. The runner imports this module; the submitting host's side
(settings against the partition, the job array) is kvq_lab.run.slurm, which imports the runner.

- `stop_reason(signame)`: why SLURM stopped the row, for its record: `time limit` (submitit's warning signal, SIGUSR2,
  sent `signal_delay_s` before the limit, or SLURM's own SIGTERM at the limit), `preempted` (SIGUSR2 at another time,
  or SIGTERM with the job going back to the queue), `cancelled` (scancel), else empty.
- `end_interrupted(e)`: after the row's record says `interrupted`: on submitit's signal, submitit requeues the job
  (the launcher's checkpoint resubmits the row, which then runs again from its start: rows keep no mid-row state)
  while its timeout budget (`max_num_timeout`) lasts; a job that will not come back returns normally, so that
  submitit writes a result file and the submitting host sees the row end (and does not wait on sacct for ever);
  a job that SLURM itself requeues exits without one, and the host waits for the rerun.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

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
