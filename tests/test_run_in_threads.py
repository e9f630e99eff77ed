"""run_in_threads runs the BLAS on one thread while two or more rank threads run, and restores it after."""
from threadpoolctl import threadpool_info, threadpool_limits

from minizero.comm import run_in_threads


def _blas_threads(comm=None):
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_rank_threads_run_a_one_thread_blas_and_the_caller_keeps_its_own():
    with threadpool_limits(limits=2, user_api="blas"):
        outer = _blas_threads()
        assert run_in_threads(2, _blas_threads) == [[1] * len(outer)] * 2
        assert run_in_threads(1, _blas_threads) == [outer]  # one rank: nothing to oversubscribe
        assert _blas_threads() == outer
