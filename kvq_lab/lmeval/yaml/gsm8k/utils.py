"""GSM8K for lm-eval-harness: lm-eval's own task definition; the data (local files when $KVQ_DATA_DIR is set) from
kvq_lab.tasks.datasets."""

from kvq_lab.tasks.datasets import load_gsm8k  # noqa: F401  (`!function utils.load_gsm8k`)
