"""Tools that find and name what went wrong in a distributed run (``python -m minizero.debug``).

    hang.py       compare the ranks' flight records (:mod:`minizero.comm.flight`): who never joined what
    replicas.py   hash parameters and optimizer state across the replicas that hold them equal (``--check-replicas``)
    anomaly.py    the first module or gradient that went non-finite (``--detect-anomaly``)
    timeline.py   per rank compute / exposed communication / bubble from ``--trace``; the straggler
    parity.py     two layouts from one seed in float64: the first step and parameter that differ
"""
