"""Kill-and-recover chaos suite: `python -m tests.chaos --seed N --faults N | --duration 2h`."""
