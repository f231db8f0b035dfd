"""The frontier search (`python run.py experiment=frontier`): which cache loses least on a model at a budget of stored
bits, and how an engine switches it on. Stages in kvq_lab/frontier/driver.py, candidates in candidates.py, the cost
plan in costs.py; decisions and the report in kvq_lab/report/frontier.py and kvq_lab/report/studies/frontier.py."""
