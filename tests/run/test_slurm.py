"""kvq_lab.run.slurm and kvq_lab.run.slurm_job without a cluster: SLURM's answers faked at the scontrol boundary.
The same behaviour on a real single-node SLURM: tests/run/test_slurm_cluster.py (marker `slurm`)."""

from __future__ import annotations

import signal
import time

import pytest

from kvq_lab.common.errors import ConfigError
from kvq_lab.run import slurm, slurm_job
from kvq_lab.run.slurm import Partition, check_resources
from kvq_lab.run.slurm_job import minutes
from kvq_lab.tasks import TaskContext


@pytest.mark.parametrize(
    "text, want",
    [("UNLIMITED", None), ("30", 30), ("1:30:00", 90), ("2-00:00:00", 2880), ("1-12", 2160), ("45:30", 45.5)],
)
def test_slurm_time_formats(text, want):
    assert minutes(text) == want


def test_gpus_of_a_nodes_gres():
    assert slurm._gpus("(null)") == 0 and slurm._gpus("gpu:4") == 4 and slurm._gpus("gpu:a100:8(S:0-1)") == 8
    assert slurm._gpus("gpu:2,shard:8") == 2


CPU_NODE = Partition("debug", max_time_min=60, cpus=2, mem_mb=20000, gpus=0)
OK = {"timeout_min": 30, "cpus_per_task": 2, "mem_gb": 8, "gpus_per_node": None, "signal_delay_s": 120}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"timeout_min": 120}, ["timeout_min=120", "MaxTime of 60", "timeout_min<=60"]),
        ({"cpus_per_task": 8}, ["cpus_per_task=8", "2 CPUs", "cpus_per_task<=2"]),
        ({"mem_gb": 48}, ["mem_gb=48", "20000 MB", "mem_gb<=19"]),
        ({"gpus_per_node": 1}, ["gpus_per_node=1", "has no GPUs", "hydra/launcher=slurm"]),
        ({"timeout_min": 1, "signal_delay_s": 90}, ["signal_delay_s=90", "timeout_min=1", "signal_delay_s<60"]),
    ],
)
def test_a_request_the_partition_cannot_satisfy_is_one_line(change, words):
    check_resources(OK, CPU_NODE)  # the defaults fit a 2-CPU node
    with pytest.raises(ConfigError) as e:
        check_resources({**OK, **change}, CPU_NODE)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_partition_is_read_from_scontrol(monkeypatch):
    out = {
        ("scontrol", "show", "partition", "-o"): "PartitionName=debug Default=YES MaxTime=02:00:00 Nodes=n1\n"
        "PartitionName=long MaxTime=UNLIMITED Nodes=n1\n",
        ("scontrol", "show", "node", "-o", "n1"): "NodeName=n1 CPUTot=2 RealMemory=19000 Gres=(null)\n",
    }
    monkeypatch.setattr(slurm, "_run", lambda args: out[tuple(args)])
    assert slurm.partition(None) == Partition("debug", 120, 2, 19000, 0)
    assert slurm.partition("long").max_time_min is None
    with pytest.raises(ConfigError, match="partition='gpu' does not exist; partitions: debug, long"):
        slurm.partition("gpu")


def test_no_slurm_on_the_host_is_one_line(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="`scontrol` not found on this host.*slurm_local.sh start"):
        slurm.partition(None)


def _in_job(monkeypatch, state: str, left_s: float, delay: int = 120, restarts: int = 0):
    """A SLURM job (id 7) 10 minutes into a limit that ends in `left_s`, as scontrol shows it; `restarts`: its
    restart count now (the run started at 0)."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv("KVQ_SIGNAL_DELAY_S", str(delay))
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    start = time.time() - 600
    job = {
        "JobState": state,
        "StartTime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start)),
        "TimeLimit": f"00:{(600 + left_s) // 60:02.0f}:{(600 + left_s) % 60:02.0f}",
        "EndTime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime()),  # a cancelled job's: now
        "Restarts": str(restarts),
    }
    monkeypatch.setattr(slurm_job, "_scontrol_job", lambda job_id: job)


@pytest.mark.parametrize(
    "signame, state, left_s, restarts, reason",
    [
        ("SIGUSR2", "RUNNING", 100, 0, "time limit"),  # submitit's warning, signal_delay_s before the end
        ("SIGUSR2", "RUNNING", 3000, 0, "preempted"),  # the same signal long before the end
        ("SIGTERM", "COMPLETING", 3000, 0, "cancelled"),  # scancel
        ("SIGTERM", "COMPLETING", 3000, 1, "preempted"),  # requeued: preemption with requeue, scontrol requeue
        ("SIGTERM", "COMPLETING", 5, 0, "time limit"),  # the limit reached without a warning
        ("SIGINT", "RUNNING", 3000, 0, ""),
    ],
)
def test_why_slurm_stopped_a_row(monkeypatch, signame, state, left_s, restarts, reason):
    _in_job(monkeypatch, state, left_s, restarts=restarts)
    assert slurm_job.stop_reason(signame) == reason


def test_a_rerun_of_a_requeued_job_is_not_requeued_again_by_its_own_count(monkeypatch):
    _in_job(monkeypatch, "COMPLETING", 3000, restarts=1)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # this run is the requeued one; scancel now
    assert slurm_job.stop_reason("SIGTERM") == "cancelled" and not slurm_job.will_be_requeued()


def test_no_reason_outside_a_slurm_job(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert slurm_job.stop_reason("SIGTERM") == "" and slurm_job.preempt_signal() is None


def test_submitits_signal_goes_to_its_handler_and_a_refused_requeue_ends_normally(monkeypatch, capsys):
    _in_job(monkeypatch, "RUNNING", 100)
    seen = []

    def requeue(signum, frame):
        seen.append(signum)
        raise SystemExit(-1)  # submitit requeued the job and exits

    with pytest.raises(SystemExit):
        slurm_job.end_interrupted(signal.SIGUSR2, requeue)

    class UncompletedJobError(RuntimeError):
        pass

    def refuse(signum, frame):
        seen.append(signum)
        raise UncompletedJobError("Job not requeued because: timed-out too many times.")

    slurm_job.end_interrupted(signal.SIGUSR2, refuse)  # returns: submitit writes the job's result
    assert seen == [signal.SIGUSR2] * 2 and "timed-out too many times" in capsys.readouterr().err


def test_sigterm_ends_normally_unless_slurm_requeues_the_job(monkeypatch):
    _in_job(monkeypatch, "COMPLETING", 3000)
    slurm_job.end_interrupted(signal.SIGTERM, None)  # scancel: the job ends, with a result
    _in_job(monkeypatch, "COMPLETING", 3000, restarts=1)
    with pytest.raises(SystemExit) as e:  # requeued by SLURM: no result; the host waits for the rerun
        slurm_job.end_interrupted(signal.SIGTERM, None)
    assert e.value.code == 143


def test_progress_counts_finished_generate_calls(tmp_path):
    ctx = TaskContext(None, None, lambda: object(), None, tmp_path, None, None)
    make = ctx.counted_caches()
    assert ctx.progress.done == 0
    make()  # the first call starts: none finished
    assert ctx.progress.done == 0
    make(), make()  # the third starts: two finished
    assert ctx.progress.done == 2 and ctx.progress.unit == "generate calls"


def test_the_launcher_stops_waiting_for_a_job_that_left_the_queue_without_a_result(monkeypatch):
    """A cluster without accounting never gives submitit a final state, and a job killed outright writes no result:
    the wait ends once squeue no longer lists the job (after a grace period) instead of looping for ever."""

    class Job:
        job_id, polls = "5_0", 0

        def done(self):
            self.polls += 1
            return False

    monkeypatch.setattr(slurm, "GONE_GRACE_S", 0.05)
    monkeypatch.setattr(slurm, "_in_queue", lambda job_id: False)
    job = Job()
    assert slurm._wait(job, poll_s=0.01) is False and job.polls >= 2
    queued = iter([True, True, False])  # requeued, pending, then gone: done only once squeue no longer lists it
    monkeypatch.setattr(slurm, "_in_queue", lambda job_id: next(queued))
    job.done = lambda: True  # sacct's last word on the killed run said done; squeue knows better
    assert slurm._wait(job, poll_s=0.01) is True
    assert next(queued, "all asked") == "all asked"  # it waited through both queued answers
