"""Every registered task (`kvq_lab.plugins.TASKS`), driven by the registry: a new task is covered with no edit here.
Each declares its options and its headline metrics (what experiment tables show), and a built-in task's conf file
sets only options the task reads."""

from pathlib import Path

import pytest
import yaml

from kvq_lab.common.metric import Metric
from kvq_lab.plugins import TASKS
from kvq_lab.tasks import Task

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_declares_its_options_and_headline_metrics(name):
    task = TASKS[name]
    assert isinstance(task, Task) and task.name == name
    assert "name" in task.options
    assert isinstance(task.headline, tuple) and all(isinstance(m, Metric) for m in task.headline)
    assert all(m.key.startswith(f"{name}/") for m in task.headline), "a task's metrics are named <task>/<metric>"
    titles = [m.title for m in task.headline]
    assert len(set(titles)) == len(titles)


@pytest.mark.parametrize("name", sorted(n for n, t in TASKS.items() if type(t).__module__.startswith("kvq_lab.")))
def test_builtin_task_has_a_conf_file_with_its_options(name):
    path = REPO / "conf" / "task" / f"{name}.yaml"
    assert path.is_file(), f"task={name} needs conf/task/{name}.yaml"
    conf = yaml.safe_load(path.read_text()) or {}
    assert conf.get("name") == name
    assert set(conf) <= set(TASKS[name].options), f"conf/task/{name}.yaml sets keys the task does not read"


def test_every_task_conf_file_names_a_registered_task():
    for path in sorted((REPO / "conf" / "task").glob("*.yaml")):
        assert (yaml.safe_load(path.read_text()) or {}).get("name") in TASKS, path.name
