"""trtinfer's benchmarks: runnable scripts (``python -m benchmarks.NAME --help``) that measure the installed project,
print a table and write a JSON file and a PNG chart to ``benchmarks/results/``, peers in the same run.

:mod:`benchmarks.machine` is the shared measuring helper: what machine a run was on, the short machine kind, the
commit, and the result file names (what was measured, the machine kind, the date). ``peer_workers/`` are scripts run
by the peers' own Python environments, not part of this package.
"""
