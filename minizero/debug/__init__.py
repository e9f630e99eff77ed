"""Tools that find and name what went wrong in a distributed run (``python -m minizero.debug``).

    hang.py       compare the ranks' flight records (:mod:`minizero.comm.flight`): who never joined what
    replicas.py   hash every parameter across the replicas that must hold it equal (``--check-replicas``)
"""
