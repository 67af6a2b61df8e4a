"""What every benchmark tool shares: arguments parsed under the CLI's one-line rules (``arguments``), bounded input
files (``inputs``), checked and atomic output files (``outputs``), table cells and plots (``tables``), the processes
a tool starts and the machine it runs on (``processes``), recipe helpers (``recipes``), random-weight models
(``random_models``), and the one module that calls slimkit's engine and stages (``engine_calls``).

Method note: docs/methods/benchmark-harness.md.
"""
