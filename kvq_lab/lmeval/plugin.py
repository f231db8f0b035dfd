"""`lm_eval --model kvq`: lm-eval's own command line finds kvq_lab's model with no wrapper.

lm-eval 0.4.x discovers no out-of-tree models (no entry-point group), so its `lm_eval` command knows `kvq` only if
`kvq` is in its model registry before the command looks the name up. `python -m kvq_lab.lmeval.plugin register`
(scripts/setup.sh runs it) writes two files into the environment's site-packages: a small standalone module
`kvq_lab_lm_eval_hook.py` (the text of `HOOK` below) and a one-line `kvq_lab_lm_eval.pth` that imports it. Python
runs the .pth line at startup: the hook puts a finder on `sys.meta_path` that waits for `lm_eval.models` to be
imported (lm-eval does so when it first looks up a model) and then registers `kvq` as a lazy placeholder
(`kvq_lab.lmeval.cli:KvqLM`), and wraps `lm_eval.__main__.cli_evaluate` so that a `--model kvq` command line has its
model args checked (`kvq_lab.lmeval.cli.check_cli`: one line, exit status 2) before lm-eval spends ~20 s on its tasks.
Nothing of kvq_lab, lm-eval or torch is imported at startup (importing the kvq_lab package there would pin it
to the installed checkout for every script, even one run from another clone or worktree); kvq_lab.lmeval.cli loads,
from whatever kvq_lab the command's sys.path finds, only when `--model kvq` is used.
`python -m kvq_lab.lmeval.plugin unregister` removes both files.

    lm_eval run --model kvq --model_args pretrained=smollm2-135m,key_axis=channel,value_axis=token,bits=2 \
        --tasks coqa_turns --include_path kvq_lab/lmeval/yaml --limit 20

Without the files, `kvq-lm-eval` (the same command with kvq_lab.lmeval.cli imported first) still works.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

PTH_NAME = "kvq_lab_lm_eval.pth"
HOOK_NAME = "kvq_lab_lm_eval_hook"
PTH_LINE = f"import {HOOK_NAME}\n"
HOOK = '''"""Registers kvq_lab\'s `kvq` model with lm-eval once lm_eval.models is imported, and checks `--model kvq`'s
model args before lm-eval's command line reads its tasks (written by `python -m kvq_lab.lmeval.plugin register`;
see kvq_lab/lmeval/plugin.py). Imports only the standard library."""
import importlib.abc
import importlib.machinery
import sys


def _register(module):
    from lm_eval.api.registry import model_registry

    if "kvq" not in model_registry.keys():
        model_registry.register("kvq", target="kvq_lab.lmeval.cli:KvqLM")


def _check_first(module):
    run = module.cli_evaluate

    def cli_evaluate():
        if "kvq" in " ".join(sys.argv):  # kvq_lab is imported only when its model is asked for
            from kvq_lab.lmeval.cli import check_cli

            check_cli(sys.argv)
        return run()

    module.cli_evaluate = cli_evaluate


_AFTER = {"lm_eval.models": _register, "lm_eval.__main__": _check_first}


class _AfterLmEvalModels(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _AFTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _AFTER[fullname](module)

        spec.loader.exec_module = exec_module
        return spec


if "lm_eval.models" in sys.modules:
    _register(sys.modules["lm_eval.models"])
if not any(type(f).__name__ == "_AfterLmEvalModels" for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterLmEvalModels())
'''


def site_dir() -> Path:
    """The site-packages folder of the running Python (where pip installs packages)."""
    return Path(sysconfig.get_paths()["purelib"])


def register(where: Path | None = None) -> Path:
    """Write the hook module and the .pth file into `where` (default: this environment's site-packages) -> the
    .pth file's path."""
    where = Path(where or site_dir())
    (where / f"{HOOK_NAME}.py").write_text(HOOK)
    path = where / PTH_NAME
    path.write_text(PTH_LINE)
    return path


def unregister(where: Path | None = None) -> Path:
    where = Path(where or site_dir())
    (where / f"{HOOK_NAME}.py").unlink(missing_ok=True)
    path = where / PTH_NAME
    path.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["register"], ["unregister"]):
        print("usage: python -m kvq_lab.lmeval.plugin register|unregister", file=sys.stderr)
        return 2
    path = (register if args[0] == "register" else unregister)()
    print(f"{args[0]}ed: {path}" if args[0] == "register" else f"removed: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
