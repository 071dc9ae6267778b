"""kiln's own thread pool in CPU packages (runtime/model/kiln_pool.h; issue 14 item 3): the
same package run at budgets 1, 2 and 3 gives the 1-thread results (generated kernels, GEMMs,
the direct convolution, sort / topk, quantised GEMV / GEMM) and eager's; packages link no
libgomp; two runners with different budgets in one process, also from two Python threads at
once; a process that imported torch first (torch's libgomp loaded) runs the package on the
pool's workers; a forked child runs a package its parent had run on several threads; the
pool's primitives on their own (a C++ driver): coverage, barrier, critical, nested regions,
exceptions."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import zipfile

import pytest
import torch
from torch import nn

import kiln
from kiln.config import cxx

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../"))
BUDGETS = (1, 2, 3)


class Mixed(nn.Module):
    """A GEMM, a dense and a depthwise convolution with a max pool, pointwise kernels with a
    row reduction over a 3-d outer space, and sort / topk (library routines)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(300, 257)
        self.conv = nn.Conv2d(16, 32, 3, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)

    def forward(self, x, img, z):
        y = torch.tanh(self.fc(x)) * 2 + 1
        c = torch.relu(self.dw(torch.relu(self.conv(img))))
        p = torch.nn.functional.max_pool2d(c, 2)
        w = torch.sigmoid(z) * z
        return y, y.sum(-1), p, w, w.amax(-1), torch.sort(y, -1)[0], torch.topk(y, 5, -1)[0]


def _args(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(389, 300, generator=g), torch.randn(3, 16, 23, 21, generator=g),
            torch.randn(5, 7, 1031, generator=g))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    m = Mixed().eval()
    return m, kiln.compile(m, _args(0)).save(tmp_path_factory.mktemp("pool") / "mixed.kiln")



def _build(tmp_path, name: str, text: str):
    """The C++ test program `text` (kiln_pool.h and the runtime headers on its include path)
    built as tmp_path / name."""
    src, exe = tmp_path / f"{name}.cpp", tmp_path / name
    src.write_text(text)
    inc = os.path.join(ROOT, "kiln", "runtime", "model")
    subprocess.run([cxx(), "-std=c++17", "-O1", "-pthread", f"-I{inc}", str(src), "-o",
                    str(exe)], check=True)
    return exe

def _run(path, n, args):
    with kiln.load(path, num_threads=n) as r:
        out = r(*args)
        return [t.clone() for t in (out if isinstance(out, (tuple, list)) else (out,))]


def test_budgets_give_the_serial_results(mixed):
    m, path = mixed
    for seed in (1, 2):
        args = _args(seed)
        serial = _run(path, 1, args)
        with torch.no_grad():
            want = m(*args)
        for g, w in zip(serial, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        for n in BUDGETS[1:]:
            for g, s in zip(_run(path, n, args), serial):
                torch.testing.assert_close(g, s, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantised_gemv_and_gemm_at_every_budget(tmp_path, mode):
    m = nn.Linear(200, 1000).eval()  # 63 panels of 16 columns
    cm = kiln.compile(m, (torch.randn(8, 200),),
                      dynamic_shapes=({0: torch.export.Dim("b", min=1, max=64)},),
                      options=kiln.Options(weight_quant=mode, weight_quant_group=24 if
                                           mode == "int4" else 32))
    assert "qgemm" in "".join(cm.sources)
    path = cm.save(tmp_path / "q.kiln")
    for rows in (1, 5, 40):  # GEMV, register blocks, dequantised panels for BLAS
        x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows))
        serial = _run(path, 1, (x,))
        tol = 0.05 if mode == "int8" else 0.5  # the grid's rounding (test_qgemm.py bounds it)
        torch.testing.assert_close(serial[0], m(x).detach(), rtol=tol, atol=tol)
        for n in BUDGETS[1:]:
            torch.testing.assert_close(_run(path, n, (x,))[0], serial[0], rtol=1e-6, atol=1e-6)


def test_package_links_no_libgomp(mixed, tmp_path):
    _, path = mixed
    with zipfile.ZipFile(path) as z:
        man = json.loads(z.read("manifest.json"))
        z.extract("lib/model.so", tmp_path)
    assert not any("gomp" in s or "OpenMP" in s for s in man["requires"]["shared_libraries"])
    ldd = subprocess.run(["ldd", str(tmp_path / "lib/model.so")], capture_output=True,
                         text=True, check=True).stdout
    assert "libscipy_openblas" in ldd  # the check can see dependencies
    assert "gomp" not in ldd and "libomp" not in ldd and "libiomp" not in ldd, ldd
    nm = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / "lib/model.so")],
                        capture_output=True, text=True, check=True).stdout
    assert "kiln_pool_set_num_threads" in nm and "kiln_pool_get_max_threads" in nm


def test_two_runners_with_different_budgets(mixed):
    m, path = mixed
    args = [_args(10 + k) for k in range(3)]
    want = [_run(path, 1, a) for a in args]
    errors: list[str] = []
    with kiln.load(path, num_threads=1) as r1, kiln.load(path, num_threads=3) as r3:
        for k, a in enumerate(args):  # alternately in one thread
            for r in (r1, r3, r1):
                for g, w in zip(r(*a), want[k]):
                    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)

        def work(r, t):
            for i in range(6):
                k = (t + i) % len(args)
                for g, w in zip(r(*args[k]), want[k]):
                    if not torch.allclose(g, w, rtol=1e-6, atol=1e-6):
                        errors.append(f"thread {t} run {i}: wrong result")

        ths = [threading.Thread(target=work, args=(r, t)) for t, r in enumerate((r1, r3, r3))]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    assert not errors, errors[:5]


_TORCH_FIRST = textwrap.dedent("""
    import json, os, sys
    import torch
    torch.set_num_threads(2)
    torch.randn(512, 512) @ torch.randn(512, 512)  # torch's OpenMP pool is started
    import kiln
    maps = open("/proc/self/maps").read()
    def tasks():
        return len(os.listdir("/proc/self/task"))
    x = (torch.randn(389, 300), torch.randn(3, 16, 23, 21), torch.randn(5, 7, 1031))
    res = {"gomp_in_process": "libgomp" in maps}
    with kiln.load(sys.argv[1], num_threads=3) as r:
        base = tasks()
        r(*x)
        res["workers"] = tasks() - base
        libs = [l.split()[-1] for l in open("/proc/self/maps") if "model.so" in l]
    res["model_libs"] = sorted(set(libs))
    print(json.dumps(res))
""")


def test_torch_imported_first_runs_on_kilns_pool(mixed):
    """torch's libgomp is loaded and started before kiln: the package still runs on its own
    pool (two workers at budget 3), whose spin policy is kiln's (no GOMP_SPINCOUNT to miss)."""
    _, path = mixed
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", _TORCH_FIRST, str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["gomp_in_process"]
    assert got["workers"] == 2, got
    for lib in got["model_libs"]:
        ldd = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
        assert "gomp" not in ldd, (lib, ldd)


_FORK = textwrap.dedent("""
    import faulthandler, os, sys
    import torch
    import kiln
    x = (torch.randn(389, 300), torch.randn(3, 16, 23, 21), torch.randn(5, 7, 1031))
    with kiln.load(sys.argv[1], num_threads=2) as r:
        want = [t.clone().numpy() for t in r(*x)]  # the parent's pool has a worker
        pid = os.fork()
        if pid == 0:  # the child: the worker does not exist here
            faulthandler.dump_traceback_later(60, exit=True)
            # compared with numpy: torch's own OpenMP (libgomp) may hang in a forked child
            ok = all((g.numpy() == w).all() for g, w in zip(r(*x), want))
            ok = ok and all((g.numpy() == w).all() for g, w in zip(r(*x), want))
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert all((g.numpy() == w).all() for g, w in zip(r(*x), want))  # the parent's too
    print("exit", os.waitstatus_to_exitcode(status))
""")


def test_forked_child_runs_the_model(mixed):
    _, path = mixed
    proc = subprocess.run([sys.executable, "-c", _FORK, str(path)],
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "exit 0", proc.stdout


_POOL_CPP = r"""
#include "kiln_pool.h"
#include <unistd.h>
#include <cstdio>
#include <stdexcept>
#include <vector>
#define CHECK(c) \
  do { if (!(c)) { std::printf("FAIL line %d: %s\n", __LINE__, #c); return 1; } } while (0)
int main(int argc, char **argv) {
  const int nt = std::atoi(argv[1]);
  kr::Pool pool;
  kr::tls().requested = nt;  // as libkiln's kiln_pool_set_num_threads
  kr::RunScope scope(&pool);
  CHECK(kr::max_threads() == nt);
  for (int64_t n : {0, 1, 2, 3, 7, 1000, 100003}) {  // every index once, static and dynamic
    std::vector<int> hits(size_t(n), 0);
    kr::parallel_for(n, nt, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) ++hits[i];
    });
    for (int h : hits) CHECK(h == 1);
    kr::parallel_for_dynamic(n, nt, [&](int64_t i) { ++hits[i]; });
    for (int h : hits) CHECK(h == 2);
  }
  // team ids, sizes, a barrier between two phases, a critical section
  std::vector<int> a(64, 0);
  long sum = 0;
  int size_seen = 0;
  kr::parallel(nt, [&](int t, int m) {
    size_seen = m;
    for (int i = t; i < 64; i += m) a[i] = i;
    kr::barrier();
    long part = 0;
    for (int i = (t + 1) % m; i < 64; i += m) part += a[i];  // another member's writes
    kr::Lock g(kr::team_critical());
    sum += part;
  });
  CHECK(size_seen == nt);
  CHECK(sum == 63 * 64 / 2);
  // nested regions run serially on the member that meets them
  int inner_sizes = 0;
  kr::parallel(nt, [&](int, int) {
    kr::parallel(nt, [&](int, int m) {
      kr::Lock g(kr::team_critical());
      inner_sizes += m;
    });
  });
  CHECK(inner_sizes == nt);
  // an exception in a member: no hang (others leave the barrier), rethrown on the caller
  for (int who = 0; who < nt; ++who) {
    bool caught = false;
    try {
      kr::parallel(nt, [&](int t, int) {
        if (t == who) throw std::runtime_error("boom");
        kr::barrier();
        kr::barrier();
      });
    } catch (const std::runtime_error &) { caught = true; }
    CHECK(caught);
  }
  // a member that is late (descheduled; here: asleep 200 ms in the first piece a worker
  // runs) has the rest of its share taken by the others: it runs that one piece (about an
  // eighth of a share) and nothing else; every index still runs once
  if (nt > 1) {
    const pthread_t caller = pthread_self();
    std::vector<int> hits(4000, 0), by_late(4000, 0);
    std::atomic<int> slept{0};
    static thread_local bool late = false;
    static thread_local bool first = true;
    kr::parallel_for(4000, nt, [&](int64_t lo, int64_t hi) {
      if (!pthread_equal(pthread_self(), caller)) {
        if (slept.fetch_add(1) == 0) {
          late = true;
          usleep(200000);
        }
      } else if (first) {  // the caller's first piece: wait (up to 10 s) for a worker to start
        first = false;
        for (int i = 0; i < 100000 && slept.load() == 0; ++i) usleep(100);
      }
      for (int64_t i = lo; i < hi; ++i) ++hits[i], by_late[i] = late;
    });
    for (int h : hits) CHECK(h == 1);
    int ran = 0;
    for (int b : by_late) ran += b;
    CHECK(ran > 0 && ran <= (4000 / nt + 7) / 8 + 1);
  }
  // the pool still works after the failures
  std::vector<int> hits(5000, 0);
  kr::parallel_for(5000, nt, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) ++hits[i];
  });
  for (int h : hits) CHECK(h == 1);
  std::printf("OK %d\n", pool.workers());
  return 0;
}
"""


@pytest.mark.parametrize("nt", [1, 2, 3, 5])
def test_pool_primitives(tmp_path, nt):
    """kiln_pool.h on its own: chunks and dynamic tasks cover a range once, team ids, barrier,
    critical, nested regions serial, an exception in any member rethrown without a hang, a late
    member's share of a parallel_for finished by the others."""
    exe = _build(tmp_path, "pool", _POOL_CPP)
    out = subprocess.run([str(exe), str(nt)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"OK {nt - 1}", out.stdout


_STATS_CPP = r"""
#include "kiln_pool.h"
#include <cstdio>
static void burn_cpu(uint64_t ns) {  // busy for `ns` of this thread's CPU time
  const uint64_t t0 = kr::pool_detail::thread_cpu_ns();
  while (kr::pool_detail::thread_cpu_ns() - t0 < ns) {}
}
int main() {
  kr::Pool pool;
  kr::tls().requested = 2;
  {
    kr::RunScope scope(&pool);
    burn_cpu(20000000);  // 20 ms serial
    for (int r = 0; r < 3; ++r)  // 3 regions: member 0 burns 30 ms, member 1 10 ms
      kr::parallel(2, [&](int t, int) { burn_cpu(t == 0 ? 30000000 : 10000000); });
  }
  std::printf("OK\n");
  return 0;
}
"""


def test_pool_stats_measure_each_members_cpu_time(tmp_path):
    """KILN_POOL_STATS=1 (bench/threads_steps.py --pool): the summary the pool prints when it
    is destroyed charges each member the CPU time of its share (not the wait for a core), the
    serial CPU time outside regions, and the critical path serial + largest members."""
    exe = _build(tmp_path, "stats", _STATS_CPP)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KILN_POOL_STATS": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr
    head = next(ln for ln in out.stderr.splitlines() if ln.startswith("kiln pool stats:"))
    tot = {k: float(v) for k, v in re.findall(
        r"(runs|serial cpu|regions' member cpu|critical path) ([0-9.]+)", head)}
    assert tot["runs"] == 1
    assert tot["serial cpu"] == pytest.approx(0.020, abs=0.004)
    assert tot["regions' member cpu"] == pytest.approx(0.120, abs=0.01)
    assert tot["critical path"] == pytest.approx(0.020 + 0.090, abs=0.01)
    (reg,) = [ln for ln in out.stderr.splitlines() if ln.startswith("kiln pool region:")]
    f = dict(re.findall(r"(team|regions|cpu_sum|cpu_max) (\d+)", reg))
    assert (f["team"], f["regions"]) == ("2", "3")
    assert int(f["cpu_max"]) * 1e-9 == pytest.approx(0.090, abs=0.01)
    # without the variable: no summary
    quiet = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "KILN_POOL_STATS"})
    assert "kiln pool" not in quiet.stderr


_ABSENT_CPP = r"""
#include "kiln_pool.h"
#include <signal.h>
#include <time.h>
#include <atomic>
#include <cstdio>
#include <vector>
#define CHECK(c) \
  do { if (!(c)) { std::printf("FAIL line %d: %s\n", __LINE__, #c); return 1; } } while (0)
static std::atomic<int> held{0};
static std::atomic<bool> release{false};
static void hold(int) {  // a worker "descheduled": parked in this handler until released
  held.fetch_add(1);
  const timespec ms{0, 1000000};
  while (!release.load()) nanosleep(&ms, nullptr);
}
int main(int argc, char **argv) {
  const int nt = std::atoi(argv[1]);
  kr::Pool pool;
  kr::tls().requested = nt;
  kr::RunScope scope(&pool);
  signal(SIGUSR1, hold);
  std::vector<pthread_t> workers(size_t(nt), pthread_self());
  kr::parallel(nt, [&](int t, int) { workers[size_t(t)] = pthread_self(); });  // all start
  for (int t = 1; t < nt; ++t) pthread_kill(workers[size_t(t)], SIGUSR1);
  for (int i = 0; i < 10000 && held.load() < nt - 1; ++i) usleep(1000);
  CHECK(held.load() == nt - 1);
  // every worker is parked: a parallel_for and a parallel_for_dynamic return without them,
  // all of the work done by the caller
  for (int r = 0; r < 3; ++r) {
    std::vector<int> hits(10007, 0);
    kr::parallel_for(10007, nt, [&](int64_t lo, int64_t hi) {
      if (!pthread_equal(pthread_self(), workers[0])) std::abort();
      for (int64_t i = lo; i < hi; ++i) ++hits[size_t(i)];
    });
    for (int h : hits) CHECK(h == 1);
    std::atomic<int> dyn{0};
    kr::parallel_for_dynamic(100, nt, [&](int64_t) { dyn.fetch_add(1); });
    CHECK(dyn.load() == 100);
  }
  CHECK(!release.load());  // nothing above waited for them
  release.store(true);
  // released, the workers find their places withdrawn and take part in later regions
  std::atomic<int> members{0};
  kr::parallel(nt, [&](int, int) { members.fetch_add(1); });
  CHECK(members.load() == nt);
  std::vector<int> hits(5000, 0);
  kr::parallel_for(5000, nt, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) ++hits[size_t(i)];
  });
  for (int h : hits) CHECK(h == 1);
  std::printf("OK\n");
  return 0;
}
"""


@pytest.mark.parametrize("nt", [2, 3])
def test_parallel_for_does_not_wait_for_workers_that_never_start(tmp_path, nt):
    """Members of a parallel_for are optional (kiln_pool.h, Worker::claim): with every worker
    parked in a signal handler (as if the OS had descheduled it), parallel_for and
    parallel_for_dynamic finish on the caller alone instead of waiting for them; released, the
    workers rejoin later regions (parallel() waits for all of its members)."""
    exe = _build(tmp_path, "absent", _ABSENT_CPP)
    out = subprocess.run([str(exe), str(nt)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr
