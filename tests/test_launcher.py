"""Which launcher started a process, read before MPI starts (minizero.launcher): a stale MPICH PMI_PORT is no
launcher, srun --mpi=pmix's ranks count as several, and every MPI program names a stale PMI_FD or PMI_PORT in one
line before MPI_Init would abort with MPICH's error stack."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from minizero import launcher, plan
from minizero.numerals import unwrapped
from tests.conftest import REPO_ROOT, mpi_env

LAUNCH_VARIABLES = ("PMI_FD", "PMI_PORT", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                    "PMIX_RANK", "SLURM_STEP_NUM_TASKS")


def _dead_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _interface_address() -> str | None:
    """An address of one of this machine's interfaces other than loopback (the route's source to a few addresses;
    a UDP connect sends nothing), or None."""
    for far in ("192.0.2.1", "10.255.255.254", "198.51.100.1", "203.0.113.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((far, 9))
            except OSError:
                continue
            if not s.getsockname()[0].startswith("127."):
                return s.getsockname()[0]
    return None


IFACE = _interface_address()
#: PMI_PORT's hosts that name this machine: mpiexec -iface puts an interface's address there (skipped without one)
HERE = ["localhost", "127.0.0.2", pytest.param(IFACE, marks=pytest.mark.skipif(IFACE is None, reason="no interface"))]


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher's variable of the shell the tests run in (a test under mpiexec, a Slurm job)."""
    for var in LAUNCH_VARIABLES + tuple(k for k in os.environ if k.startswith(("PMIX_SERVER_URI", "PALS_", "PMI_"))):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("host", [*HERE, socket.gethostname(), "elsewhere"])  # the last: connected to
def test_a_stale_pmi_port_is_no_launcher(clean_env, capsys, host):
    """PMI_PORT left in a shell, nothing listening there: before, any PMI_PORT counted as a launcher, so rank 1
    exited 2 silently and rank 0 said "mpiexec started 2 ranks"; now it is named as a stale PMI_FD is."""
    if host == "elsewhere":  # another machine's launcher, connected to (here 127.0.0.2, taken for another host's)
        clean_env.setattr(launcher, "_this_host", lambda h: False)
        host = "127.0.0.2"
    port = _dead_port("127.0.0.1" if host in ("localhost", socket.gethostname()) else host)
    for k, v in {"PMI_SIZE": "2", "PMI_RANK": "1", "PMI_PORT": f"{host}:{port}"}.items():
        clean_env.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "tiny", "--gpus", "2"])
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == "" and unwrapped(out.err) == [
        "python -m minizero.plan: error: PMI_SIZE=2 PMI_RANK=1 are set, but no MPI launcher started this process: "
        "unset PMI_SIZE PMI_RANK PMI_PORT (this program runs in one process, without mpiexec)"], out


@pytest.mark.parametrize("host", HERE)
def test_a_listened_pmi_port_is_a_launcher_and_a_port_of_this_host_is_not_connected_to(clean_env, host):
    """MPICH's hydra (mpiexec -pmi-port) listens there; its proxy spins on a connection closed unused (a core for
    the whole job, measured), so a port of this host is looked up in /proc/net/tcp, not connected to: before, only
    at localhost, 127.0.0.1, ::1 or the host's name, not at an interface's address (mpiexec -iface) nor 127.0.0.2."""
    with socket.socket() as server:
        server.bind(("127.0.0.1" if host == "localhost" else host, 0))
        server.listen(4)
        server.settimeout(0.3)
        clean_env.setenv("PMI_PORT", f"{host}:{server.getsockname()[1]}")
        assert launcher.launcher_connected()
        if os.path.exists("/proc/net/tcp"):
            with pytest.raises(socket.timeout):
                server.accept()[0].close()  # nobody connected
        clean_env.setenv("PMI_FD", "2")  # MPICH reads PMI_FD first: a PMI_FD that is no socket fails MPI_Init
        assert not launcher.launcher_connected()


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("server,said", [
    (True, ["python -m minizero.plan: error: runs in one process; mpiexec started 2 ranks: run it without mpirun "
            "(or with -n 1)"]),
    (False, ["python -m minizero.plan: error: SLURM_STEP_NUM_TASKS=2 PMIX_RANK={rank} are set, but no MPI launcher "
             "started this process: unset SLURM_STEP_NUM_TASKS PMIX_RANK (this program runs in one process, "
             "without mpiexec)"])])
def test_srun_pmix_ranks_count_as_several(clean_env, capsys, rank, server, said):
    """``srun --mpi=pmix -n 2``: each task has PMIX_RANK and Slurm's SLURM_STEP_NUM_TASKS, no PMI_SIZE. Before,
    every one-process tool saw one rank on each task and both did the same work (plan printed twice)."""
    clean_env.setenv("PMIX_RANK", rank)
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "2")
    if server:
        clean_env.setenv("PMIX_SERVER_URI41", "pmix-server.1;tcp4://127.0.0.1:1")
    assert launcher.launched_ranks() == 2 and launcher.launched_rank() == int(rank)
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "tiny", "--gpus", "2"])
    out = capsys.readouterr()
    quiet = server and rank == "1"  # rank 0 speaks for a real launch; a stale one is named on every rank
    assert e.value.code == 2 and out.out == "" and unwrapped(out.err) == ([] if quiet else
                                                                         [s.format(rank=rank) for s in said]), out


def test_slurm_s_task_count_without_pmix_is_not_a_launch(clean_env):
    """A batch script's shell has SLURM_STEP_NUM_TASKS / SLURM_NTASKS and no PMIX_RANK: a tool run there is one
    process (srun without --mpi=pmix starts independent processes, which this does not guess at)."""
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert launcher.launched_ranks() == 1 and launcher.launched_rank() == 0


def _stale(argv, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in mpi_env().items() if not k.startswith(("PMI", "OMPI_", "PMIX", "SLURM_"))}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          stdin=subprocess.DEVNULL, env=dict(clean, PMI_SIZE="2", PMI_RANK="1", **env))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv,prog", [
    (["-m", "minizero.hardware", "--allreduce", "4"], "python -m minizero.hardware"),
    (["bench/bench_header.py"], "bench_header.py"),
    (["bench/bench_setup_peak.py", "--model", "tiny"], "bench_setup_peak.py"),  # starts MPI on import
    (["bench/bench_allreduce.py"], "bench_allreduce.py"),
    (["bench/profile_collective.py"], "profile_collective.py"),
    (["bench/bench_multihost.py", "--rank"], "bench_multihost.py"),
    (["bench/gpu_check.py", "--nccl-worker", "nccl.json"], "gpu_check.py")])
def test_a_stale_pmi_fd_is_one_line_in_every_mpi_program(argv, prog):
    """PMI_FD left in a shell (here stderr's descriptor, a pipe): before, only train and finetune named it; the
    hardware tool and the bench scripts that start MPI themselves aborted with MPICH's error stack, exit 15."""
    proc = _stale(argv, PMI_FD="2")
    assert proc.returncode == 2 and proc.stdout == "" and unwrapped(proc.stderr) == [
        f"{prog}: error: PMI_FD=2 is set, but names no MPI launcher's socket (mpiexec sets it): "
        "unset PMI_FD PMI_SIZE PMI_RANK, or start this under mpiexec"], proc.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv,prog", [
    (["-m", "minizero.train", "--model", "tiny", "--steps", "1", "--no-save"], "python -m minizero.train"),
    (["bench/bench_header.py"], "bench_header.py")])
def test_a_stale_pmi_port_is_named_before_mpi_starts(argv, prog):
    """PMI_PORT left in a shell, nothing listening there: before, MPI_Init aborted with MPICH's error stack
    ("connect failed with connection refused", 'PMI_Init returned -1'), exit 15."""
    port = f"localhost:{_dead_port()}"
    proc = _stale(argv, PMI_PORT=port)
    assert proc.returncode == 2 and proc.stdout == "" and unwrapped(proc.stderr) == [
        f"{prog}: error: PMI_PORT={port} is set, but no MPI launcher listens there (mpiexec sets it): "
        "unset PMI_PORT PMI_SIZE PMI_RANK, or start this under mpiexec"], proc.stderr


def test_pmi_variables_beside_a_pmix_server_are_stale(clean_env, capsys):
    """PMI_SIZE=2 PMI_RANK=1 left in a shell that has a PMIx server's URI: MPICH reads PMI_* only beside its own
    PMI_FD / PMI_PORT, so this is one process; before, it counted as a launch and "rank 1" exited 2 silently."""
    for k, v in {"PMI_SIZE": "2", "PMI_RANK": "1", "PMIX_SERVER_URI41": "pmix-server.1;tcp4://127.0.0.1:1"}.items():
        clean_env.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "tiny", "--gpus", "2"])
    out = capsys.readouterr()
    assert e.value.code == 2 and unwrapped(out.err) == [
        "python -m minizero.plan: error: PMI_SIZE=2 PMI_RANK=1 are set, but no MPI launcher started this process: "
        "unset PMI_SIZE PMI_RANK (this program runs in one process, without mpiexec)"], out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv,prog", [
    (["-m", "minizero.hardware", "--allreduce", "1024", "--runs", "1"], "python -m minizero.hardware"),
    (["-m", "minizero.train", "--model", "tiny", "--steps", "1", "--out", "o"], "python -m minizero.train"),
    (["bench/bench_header.py"], "bench_header.py")])
@pytest.mark.parametrize("env", [{"PMIX_RANK": "1"}, {"PMIX_NAMESPACE": "slurm.pmix.1.0", "PMIX_RANK": "0"}])
def test_a_stale_pmix_rank_is_one_line_in_every_mpi_program(argv, prog, env):
    """PMIX_RANK or PMIX_NAMESPACE left in a shell, no PMIx server (no PMIX_SERVER_URI*): before, MPI_Init aborted
    with MPICH's error stack ("unsupported PMI version PMIx", "launcher not compatible with PMI1 client")."""
    clean = {k: v for k, v in mpi_env().items() if not k.startswith(("PMI", "OMPI_", "PMIX", "SLURM_"))}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          stdin=subprocess.DEVNULL, env=dict(clean, SLURM_STEP_NUM_TASKS="abc", **env))
    said = " ".join(f"{k}={env[k]}" for k in ("PMIX_RANK", "PMIX_NAMESPACE") if k in env)
    assert proc.returncode == 2 and proc.stdout == "" and unwrapped(proc.stderr) == [
        f"{prog}: error: {said} {'is' if len(env) == 1 else 'are'} set, but no PMIx server started this process "
        f"(no PMIX_SERVER_URI* variable; srun --mpi=pmix sets them): unset {' '.join(sorted(env))}, or start this "
        "under mpiexec"], proc.stderr


@pytest.mark.timeout(120)
def test_a_stale_pmix_rank_beside_a_live_mpiexec_is_no_refusal(mpiexec):
    """PMIX_RANK left in a shell, the program under a live hydra (PMI_FD a socket): MPICH reads PMI_FD and ignores
    PMIx, yet every rank exited 2, telling the user to unset the live launcher's PMI_FD PMI_SIZE PMI_RANK."""
    clean = {k: v for k, v in mpi_env().items() if not k.startswith(("PMI", "OMPI_", "PMIX", "SLURM_"))}
    proc = subprocess.run([mpiexec, "-n", "2", "env", "PMIX_RANK=1", sys.executable, "bench/bench_header.py",
                           "--runs", "2", "--sizes", "4096"], capture_output=True, text=True, timeout=100,
                          cwd=REPO_ROOT, stdin=subprocess.DEVNULL, env=clean)
    assert proc.returncode == 0 and "| 4 KiB |" in proc.stdout and "PMIX" not in proc.stderr, proc.stderr


@pytest.fixture
def mute_launcher():
    """A PMI_PORT where a program that is no PMI launcher listens: it accepts and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        accepted = []

        def accept():
            try:
                while True:
                    accepted.append(server.accept()[0])
            except OSError:  # closed at the end
                pass

        threading.Thread(target=accept, daemon=True).start()
        yield f"127.0.0.1:{server.getsockname()[1]}", accepted
        for conn in accepted:
            conn.close()


MPI_STARTS = [(["-m", "minizero.hardware", "--allreduce", "4", "--runs", "1"], "python -m minizero.hardware"),
              (["bench/bench_header.py", "--sizes", "4096", "--runs", "1"], "bench_header.py")]


def _as_from_a_terminal():
    """In the child: SIGINT's default action, as a program started from a terminal has it. pytest started as a
    background job of a script (``cmd &`` in ``bash -c``) inherits SIGINT ignored, and so did bench_header: Python
    installs no handler for an ignored SIGINT, mpi_start_guarded leaves it ignored, and the Ctrl-C below was lost
    (the test failed on every run started that way)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [a for a, _ in MPI_STARTS])
def test_a_stalled_mpi_init_ends_on_ctrl_c(mute_launcher, argv):
    """Ctrl-C while MPI_Init waits on a mute PMI_PORT: bench_header (no Interrupts installed: Python's own handler,
    which cannot run inside MPI_Init) ignored it until the 600 s watchdog; now SIGINT's default action ends it."""
    port, accepted = mute_launcher
    clean = {k: v for k, v in mpi_env().items() if not k.startswith(("PMI", "OMPI_", "PMIX", "SLURM_"))}
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT,
                            stdin=subprocess.DEVNULL, env=dict(clean, PMI_PORT=port, PMI_RANK="0", PMI_SIZE="2"),
                            preexec_fn=_as_from_a_terminal)
    try:
        deadline = time.monotonic() + 60
        while not accepted and time.monotonic() < deadline:  # MPI_Init has connected: it waits there
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) in (130, -signal.SIGINT)
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,prog", MPI_STARTS)
def test_a_stalled_mpi_init_ends_on_sigterm_and_after_comm_timeout(mute_launcher, argv, prog):
    """MPI_Init waiting on a stale PMI_PORT where something else listens: before, SIGTERM and SIGINT did nothing
    (the tools' Python handlers never run inside MPI_Init) and it waited for ever. Now SIGTERM ends it, and a
    watchdog ends it after --comm-timeout s with one line."""
    port, accepted = mute_launcher
    clean = {k: v for k, v in mpi_env().items() if not k.startswith(("PMI", "OMPI_", "PMIX", "SLURM_"))}
    run = dict(cwd=REPO_ROOT, stdin=subprocess.DEVNULL, env=dict(clean, PMI_PORT=port), text=True)
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, **run)
    try:
        deadline = time.monotonic() + 60
        while not accepted and time.monotonic() < deadline:  # MPI_Init has connected: it waits there
            time.sleep(0.1)
        time.sleep(0.5)
        proc.terminate()
        assert proc.wait(timeout=20) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.communicate()
    proc = subprocess.run([sys.executable, *argv, "--comm-timeout", "3"], capture_output=True, timeout=60, **run)
    assert proc.returncode == -signal.SIGTERM and proc.stdout == "" and unwrapped(proc.stderr) == [
        f"{prog}: error: MPI_Init waited 3 s for its launcher (PMI_PORT={port}) and was ended: unset PMI_PORT if no "
        "mpiexec started this"], proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_launch_size_without_a_launcher_is_refused_before_training(tmp_path, rank):
    """``PMI_RANK=0 PMI_SIZE=4 python -m minizero.train``, no launcher: before, MPI started a world of 1 and the
    process trained alone, exit 0 (four such processes: four copies of a one-process run into one --out)."""
    clean = {k: v for k, v in mpi_env().items() if not k.startswith(("PMI", "OMPI_", "PMIX", "SLURM_"))}
    proc = subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "1", "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=100, cwd=REPO_ROOT,
                          stdin=subprocess.DEVNULL, env=dict(clean, PMI_RANK=rank, PMI_SIZE="4"))
    assert proc.returncode == 2 and proc.stdout == "" and unwrapped(proc.stderr) == [
        f"python -m minizero.train: error: PMI_SIZE=4 PMI_RANK={rank} say 4 ranks, but no MPI launcher started this "
        "process and MPI runs it alone (a world of 1): unset PMI_SIZE PMI_RANK, or start it with mpiexec -n 4"], \
        proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_launcher_of_another_mpi_is_named_as_a_mismatch(clean_env):
    """Open MPI's mpirun starting an MPICH mpi4py: each process is a world of 1 beside OMPI_COMM_WORLD_SIZE=4."""
    clean_env.setattr(launcher, "launcher_connected", lambda: True)
    assert launcher.launcher_mismatch(1) is None  # no launcher's size: one process, as asked
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "2")
    assert launcher.launcher_mismatch(4) is None  # the launcher's world: MPI connected to it
    assert launcher.launcher_mismatch(1, "MPICH Version: 5.0.2") == (
        "OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_RANK=2 say the launcher started 4 ranks, but MPI sees a world of 1 "
        "in this process: a launcher mismatch (mpiexec of another MPI than mpi4py's: MPICH Version: 5.0.2); start "
        "the job with the mpiexec of the same MPI")
