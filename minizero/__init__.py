"""minizero: distributed and memory-efficient training, written by hand on NumPy and MPI.

See README.md for the two commands, ARCHITECTURE.md for the seams, and lessons/ for one chapter per technique.
"""
__version__ = "0.1.0"
