"""gpuvisor's benchmarks: `python -m tests.benchmarks [--quick] [--json PATH] [--only NAME,...]`.

Each module measures one thing on real processes and sockets and returns rows of figures; the
runner prints one table and a JSON document. The module contract is in `common.py`.
"""
