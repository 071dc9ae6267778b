/* kiln_pool.h - kiln's own thread pool, compiled into every generated CPU model.so (namespace
 * kr). CPU packages parallelise through it instead of OpenMP: no libgomp is linked (packages
 * are compiled with -fopenmp-simd, which keeps `#pragma omp simd` and nothing else), so the
 * spin-wait of idle threads is kiln's own and does not depend on who loaded libgomp first
 * (BENCHMARKS.md, "CPU: kiln's own thread pool (issue 14 item 3)").
 *
 * - One Pool per model instance (the wrapper's Instance holds it): its worker threads are
 *   started on the first region that needs them (up to the largest team asked for), and
 *   joined when the instance is destroyed. libkiln serialises runs of one instance, so one
 *   pool serves one run at a time.
 * - A run's entry point opens a RunScope: on the calling thread, kernels then reach the
 *   instance's pool and the run's thread budget through a thread_local (tls()). Without a
 *   scope (a kernel called from the debugging model.py, a test driver) regions run serially.
 * - The budget: kiln_pool_set_num_threads(n) (exported, per calling thread, as OpenMP's
 *   nthreads-var: libkiln sets it around each run, runtime/src/api.cpp), else
 *   default_threads(): OMP_NUM_THREADS when set (kept for compatibility), else the CPUs this
 *   process may run on.
 * - The calling thread is member 0 of every team. Waiting threads (workers between regions,
 *   the caller at a region's end, a barrier) spin for spin_ns (KILN_SPIN_US, default 20 us;
 *   bench/threads_cpu.py --variant KILN_SPIN_US=...) and then sleep on a futex.
 * - A region inside a region (nested) runs serially on the thread that meets it.
 * - Members of a parallel_for (and parallel_for_dynamic) are optional: a worker claims its
 *   place when it wakes (Worker::claim), and the caller, once it has run out of work (its
 *   own share and whatever it could take from the others'), withdraws the places not yet
 *   claimed and waits only for the members that started. A worker the OS has not scheduled
 *   (a loaded machine) then does not hold the region up for a time slice: the caller does its
 *   share instead. A withdrawn worker finds its place taken back when it wakes and waits for
 *   the next region. parallel() members are all required (they may split work by member id
 *   and meet at barriers).
 * - An exception in a team member is caught, the team's barriers are released (the others
 *   leave them with TeamAborted), the region ends and the first exception is rethrown on the
 *   calling thread: nothing hangs.
 * - KILN_POOL_STATS=1 in the environment (read when a pool is made): every region's members
 *   measure the CPU time of their share (CLOCK_THREAD_CPUTIME_ID), runs the CPU time of their
 *   calling thread; the pool prints a summary on stderr when destroyed: per region body (its
 *   code address, for bench/threads_steps.py --pool to name), the regions, the summed and the
 *   largest member's CPU time, and over all runs the serial CPU time (outside regions) and the
 *   critical path (serial + the largest member of every region): the time the runs would take
 *   with a core per member, however loaded the machine is (bench/threads_steps.py --pool).
 *   Off: one predictable branch per region.
 * - fork: a child process has only the forking thread. A pthread_atfork handler bumps an
 *   epoch; a pool whose workers were started in an older epoch forgets them (it cannot join
 *   threads that do not exist in the child) and starts fresh ones on its next region, so a
 *   child can run the model it inherited. (The pool must not be in a region at fork time,
 *   which holds because the forking thread is then not in a run of that instance.)
 */
#ifndef KILN_POOL_H
#define KILN_POOL_H

#include <dlfcn.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <type_traits>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
/* the builtin, not <immintrin.h>: that header alone costs ~0.45 s of every kernel file's compile */
#define KR_POOL_PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define KR_POOL_PAUSE() asm volatile("yield" ::: "memory")
#else
#define KR_POOL_PAUSE() asm volatile("" ::: "memory")
#endif

namespace kr {

namespace pool_detail {

inline void futex_wait(std::atomic<uint32_t> *a, uint32_t v) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t *>(a), FUTEX_WAIT_PRIVATE, v, nullptr,
            nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t> *a) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t *>(a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
            nullptr, 0);
}
inline uint64_t now_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

/* Waits until *a != v: spins spin_ns, then sleeps on the futex (`sleepers` counts the
 * sleepers so that wakers skip the system call when nobody sleeps). `abort` (may be NULL)
 * ends the wait early when it becomes non-zero (checked by the waker's wake too). */
inline void wait_change(std::atomic<uint32_t> &a, uint32_t v, std::atomic<uint32_t> &sleepers,
                        uint64_t spin_ns, const std::atomic<uint32_t> *abort = nullptr) {
  uint64_t deadline = 0;
  for (uint32_t i = 0;; ++i) {
    if (a.load(std::memory_order_acquire) != v) return;
    if (abort && abort->load(std::memory_order_acquire)) return;
    if ((i & 63) == 0) {
      const uint64_t t = now_ns();
      if (!deadline) deadline = t + spin_ns;
      else if (t >= deadline) break;
    }
    KR_POOL_PAUSE();
  }
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  while (a.load(std::memory_order_seq_cst) == v &&
         !(abort && abort->load(std::memory_order_seq_cst)))
    futex_wait(&a, v);
  sleepers.fetch_sub(1, std::memory_order_relaxed);
}
/* After changing `a` (seq_cst): wakes its sleepers, if any. */
inline void wake(std::atomic<uint32_t> &a, std::atomic<uint32_t> &sleepers) {
  if (sleepers.load(std::memory_order_seq_cst)) futex_wake_all(&a);
}

inline std::atomic<uint32_t> &fork_epoch() {
  static std::atomic<uint32_t> epoch{0};  // bumped in every forked child (pthread_atfork)
  return epoch;
}
inline void on_fork_child() { fork_epoch().fetch_add(1, std::memory_order_relaxed); }
inline void watch_forks() {
  static const int once = ::pthread_atfork(nullptr, nullptr, on_fork_child);  // thread-safe
  (void)once;
}

inline uint64_t thread_cpu_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

inline bool stats_from_env() {
  const char *s = std::getenv("KILN_POOL_STATS");
  return s && *s && *s != '0';
}

/* KILN_POOL_STATS: per region body (its code address), summed over its regions. */
struct RegionStats {
  const void *fn = nullptr;
  int team = 0;
  uint64_t regions = 0, cpu_sum_ns = 0, cpu_max_ns = 0, wall_ns = 0;
};
struct Stats {
  static constexpr int kSlots = 128;
  RegionStats slot[kSlots];
  int used = 0;
  uint64_t runs = 0, run_cpu_ns = 0, region_caller_cpu_ns = 0, run_wall_ns = 0;
  uint64_t member_cpu_ns[256] = {};  // the region in progress, per member
  RegionStats &at(const void *fn, int team) {
    for (int i = 0; i < used; ++i)
      if (slot[i].fn == fn && slot[i].team == team) return slot[i];
    RegionStats &r = slot[used < kSlots ? used++ : kSlots - 1];
    if (!r.fn) r.fn = fn, r.team = team;
    return r;
  }
  void print() const {
    uint64_t path = 0, sum = 0, serial = run_cpu_ns - region_caller_cpu_ns;
    for (int i = 0; i < used; ++i) path += slot[i].cpu_max_ns, sum += slot[i].cpu_sum_ns;
    std::fprintf(stderr,
                 "kiln pool stats: runs %llu, wall %.6f s, caller cpu %.6f s, serial cpu %.6f s, "
                 "regions' member cpu %.6f s, critical path %.6f s\n",
                 (unsigned long long)runs, run_wall_ns * 1e-9, run_cpu_ns * 1e-9, serial * 1e-9,
                 sum * 1e-9, (serial + path) * 1e-9);
    for (int i = 0; i < used; ++i) {
      const RegionStats &r = slot[i];
      Dl_info info;
      const bool named = ::dladdr(r.fn, &info) && info.dli_fname;
      std::fprintf(stderr, "kiln pool region: %s+0x%llx team %d regions %llu cpu_sum %llu "
                   "cpu_max %llu wall %llu\n", named ? info.dli_fname : "?",
                   (unsigned long long)(named ? (const char *)r.fn - (const char *)info.dli_fbase
                                              : (uintptr_t)r.fn),
                   r.team, (unsigned long long)r.regions, (unsigned long long)r.cpu_sum_ns,
                   (unsigned long long)r.cpu_max_ns, (unsigned long long)r.wall_ns);
    }
  }
};

inline uint64_t spin_ns_from_env() {
  const char *s = std::getenv("KILN_SPIN_US");
  if (s && *s) {
    char *end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end != s && v >= 0 && v <= 1000000) return uint64_t(v) * 1000u;
  }
  return 20000;  // 20 us
}

}  // namespace pool_detail

/* A mutex and its guard on pthreads: <mutex> would add ~0.2 s to every kernel file's compile. */
class Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex &) = delete;
  Mutex &operator=(const Mutex &) = delete;
  ~Mutex() { ::pthread_mutex_destroy(&m_); }
  void lock() { ::pthread_mutex_lock(&m_); }
  void unlock() { ::pthread_mutex_unlock(&m_); }

 private:
  pthread_mutex_t m_ = PTHREAD_MUTEX_INITIALIZER;
};

class Lock {
 public:
  explicit Lock(Mutex &m) : m_(m) { m_.lock(); }
  Lock(const Lock &) = delete;
  Lock &operator=(const Lock &) = delete;
  ~Lock() { m_.unlock(); }

 private:
  Mutex &m_;
};

/* Thrown in the members of a team left at a barrier by a member that failed. */
struct TeamAborted {};

/* The team of one region, shared by its members. */
struct Team {
  int size = 1;
  uint64_t spin_ns = 0;
  std::atomic<uint32_t> arrived{0};
  std::atomic<uint32_t> phase{0};
  std::atomic<uint32_t> sleepers{0};
  std::atomic<uint32_t> failed{0};
  uint64_t *member_cpu = nullptr;  // KILN_POOL_STATS: each member's CPU time in this region
  Mutex mu;  // team_critical
  Mutex error_mu;
  std::exception_ptr error;  // the first exception of a member (under error_mu)

  void fail(std::exception_ptr e) {
    {
      Lock g(error_mu);
      if (!error) error = std::move(e);
    }
    failed.store(1, std::memory_order_seq_cst);
    phase.fetch_add(1, std::memory_order_seq_cst);  // releases the barrier's waiters
    pool_detail::futex_wake_all(&phase);
  }
  void barrier() {
    if (size <= 1) return;
    const uint32_t ph = phase.load(std::memory_order_acquire);
    if (failed.load(std::memory_order_acquire)) throw TeamAborted{};
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == uint32_t(size)) {
      arrived.store(0, std::memory_order_relaxed);
      phase.fetch_add(1, std::memory_order_seq_cst);
      pool_detail::wake(phase, sleepers);
    } else {
      pool_detail::wait_change(phase, ph, sleepers, spin_ns, &failed);
    }
    if (failed.load(std::memory_order_acquire)) throw TeamAborted{};
  }
};

class Pool;

/* Per-thread state: the pool and budget of the run this thread is in (RunScope), the team of
 * the region it is in, and the budget libkiln asked for (kiln_pool_set_num_threads). */
struct PoolThread {
  Pool *pool = nullptr;
  int budget = 1;
  Team *team = nullptr;
  int requested = 0;  // 0: default_threads()
};
inline PoolThread &tls() {
  static thread_local PoolThread t;
  return t;
}

/* Threads of a run without a set budget: OMP_NUM_THREADS (its first number) when set, else the
 * CPUs this process may run on (sched_getaffinity), read once. */
inline int default_threads() {
  static const int n = [] {
    if (const char *s = std::getenv("OMP_NUM_THREADS")) {
      char *end = nullptr;
      const long v = std::strtol(s, &end, 10);
      if (end != s && v > 0 && v <= 4096) return int(v);
    }
    cpu_set_t set;
    if (::sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
      return CPU_COUNT(&set);
    const long c = ::sysconf(_SC_NPROCESSORS_ONLN);
    return c > 0 ? int(c) : 1;
  }();
  return n;
}
inline int requested_threads() {
  const int r = tls().requested;
  return r > 0 ? r : default_threads();
}

class Pool {
 public:
  static constexpr int kMaxTeam = 256;  // larger budgets (up to libkiln's 4096) are capped

  Pool() : spin_ns_(pool_detail::spin_ns_from_env()) {
    pool_detail::watch_forks();
    if (pool_detail::stats_from_env()) stats_ = new pool_detail::Stats;
  }
  ~Pool() {
    stop();
    if (stats_) {
      stats_->print();
      delete stats_;
    }
  }
  pool_detail::Stats *stats() { return stats_; }
  Pool(const Pool &) = delete;
  Pool &operator=(const Pool &) = delete;

  uint64_t spin_ns() const { return spin_ns_; }
  int workers() const { return n_workers_; }

  /* Runs fn(ctx, t, nt) for t in [0, nt): t = 0 on the calling thread, the others on workers
   * (started when first needed). Returns when all are done; rethrows the first exception.
   * `optional`: members 1.. may be left out (fn(ctx, 0, nt) must then do all the work the
   * absent members leave, as parallel_for's shares do): the places of workers that have not
   * started when member 0 returns are withdrawn, and only the started ones are waited for. */
  void run(int nt, void (*fn)(void *, int, int), void *ctx, bool optional = false) {
    if (nt > kMaxTeam) nt = kMaxTeam;
    if (epoch_ != pool_detail::fork_epoch().load(std::memory_order_relaxed)) forget_workers();
    if (nt > n_workers_ + 1) grow(nt - 1);
    if (nt > n_workers_ + 1) nt = n_workers_ + 1;  // fewer when a thread could not start
    Team team;
    team.size = nt;
    team.spin_ns = spin_ns_;
    uint64_t wall0 = 0, cpu0 = 0;
    if (stats_) {
      team.member_cpu = stats_->member_cpu_ns;
      for (int i = 0; i < nt; ++i) stats_->member_cpu_ns[i] = 0;  // a withdrawn member: 0
      wall0 = pool_detail::now_ns();
      cpu0 = pool_detail::thread_cpu_ns();
    }
    fn_ = fn;
    ctx_ = ctx;
    team_ = &team;
    pending_.store(uint32_t(nt - 1), std::memory_order_relaxed);
    for (int w = 0; w < nt - 1; ++w) {
      Worker &k = *workers_[w];
      k.claim.store(kPosted, std::memory_order_release);  // after fn_, ctx_, team_
      k.go.fetch_add(1, std::memory_order_seq_cst);
      pool_detail::wake(k.go, k.sleepers);
    }
    member(&team, fn, ctx, 0);
    if (optional) {
      for (int w = 0; w < nt - 1; ++w) {
        uint32_t posted = kPosted;
        if (workers_[w]->claim.compare_exchange_strong(posted, kWithdrawn,
                                                       std::memory_order_acq_rel))
          pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
    // wait for the others
    for (;;) {
      const uint32_t p = pending_.load(std::memory_order_acquire);
      if (p == 0) break;
      pool_detail::wait_change(pending_, p, done_sleepers_, spin_ns_);
    }
    if (stats_) {
      pool_detail::RegionStats &r = stats_->at(reinterpret_cast<const void *>(fn), nt);
      uint64_t mx = 0;
      for (int i = 0; i < nt; ++i) {
        r.cpu_sum_ns += stats_->member_cpu_ns[i];
        if (stats_->member_cpu_ns[i] > mx) mx = stats_->member_cpu_ns[i];
      }
      r.cpu_max_ns += mx;
      r.regions += 1;
      r.wall_ns += pool_detail::now_ns() - wall0;
      stats_->region_caller_cpu_ns += pool_detail::thread_cpu_ns() - cpu0;
    }
    if (team.error) std::rethrow_exception(team.error);
  }

 private:
  // Worker::claim: the worker's place in the region in progress
  static constexpr uint32_t kPosted = 1, kRunning = 2, kWithdrawn = 3;

  struct alignas(64) Worker {
    std::atomic<uint32_t> go{0};
    std::atomic<uint32_t> claim{0};  // kPosted by the caller; the worker takes it (kRunning)
                                     // or, in an optional region, the caller withdraws it
    std::atomic<uint32_t> sleepers{0};
    pthread_t thread{};
    Pool *pool = nullptr;
    int id = 0;  // team member id (1..)
  };

  static void member(Team *team, void (*fn)(void *, int, int), void *ctx, int t) {
    PoolThread &me = tls();
    PoolThread saved = me;
    me.team = team;
    const uint64_t c0 = team->member_cpu ? pool_detail::thread_cpu_ns() : 0;
    try {
      fn(ctx, t, team->size);
    } catch (const TeamAborted &) {
      // another member failed first; its exception is the region's
    } catch (...) {
      team->fail(std::current_exception());
    }
    if (team->member_cpu) team->member_cpu[t] = pool_detail::thread_cpu_ns() - c0;
    me.pool = saved.pool;
    me.team = saved.team;
  }

  static void *main(void *arg) {
    Worker &k = *static_cast<Worker *>(arg);
    Pool &p = *k.pool;
    PoolThread &me = tls();
    me.pool = nullptr;  // regions met inside a member run serially
    me.budget = 1;
    uint32_t seen = 0;
    for (;;) {
      pool_detail::wait_change(k.go, seen, k.sleepers, p.spin_ns_);
      seen = k.go.load(std::memory_order_acquire);
      if (p.stopping_.load(std::memory_order_acquire)) return nullptr;
      uint32_t posted = kPosted;
      if (!k.claim.compare_exchange_strong(posted, kRunning, std::memory_order_acq_rel))
        continue;  // withdrawn: that region ended without this member
      member(p.team_, p.fn_, p.ctx_, k.id);
      if (p.pending_.fetch_sub(1, std::memory_order_seq_cst) == 1)
        pool_detail::wake(p.pending_, p.done_sleepers_);
    }
  }

  void grow(int n) {
    if (n > kMaxWorkers) n = kMaxWorkers;
    while (n_workers_ < n) {
      Worker *k = new Worker;
      k->pool = this;
      k->id = n_workers_ + 1;
      if (::pthread_create(&k->thread, nullptr, &Pool::main, k) != 0) {
        delete k;
        break;
      }
      workers_[n_workers_++] = k;
    }
    epoch_ = pool_detail::fork_epoch().load(std::memory_order_relaxed);
  }

  void stop() {
    if (epoch_ != pool_detail::fork_epoch().load(std::memory_order_relaxed)) {
      forget_workers();
      return;
    }
    stopping_.store(true, std::memory_order_seq_cst);
    for (int i = 0; i < n_workers_; ++i) {
      workers_[i]->go.fetch_add(1, std::memory_order_seq_cst);
      pool_detail::futex_wake_all(&workers_[i]->go);
    }
    for (int i = 0; i < n_workers_; ++i) {
      ::pthread_join(workers_[i]->thread, nullptr);
      delete workers_[i];
    }
    n_workers_ = 0;
  }

  // In a forked child: the workers are the parent's; their records (not the threads, which do
  // not exist here) are dropped without joining.
  void forget_workers() {
    n_workers_ = 0;  // the records are leaked on purpose: each is a dead thread's slot
    epoch_ = pool_detail::fork_epoch().load(std::memory_order_relaxed);
  }

  static constexpr int kMaxWorkers = 255;  // a team is capped at 256 members
  Worker *workers_[kMaxWorkers] = {};
  int n_workers_ = 0;
  uint32_t epoch_ = 0;
  uint64_t spin_ns_;
  // the region in progress (written by the caller before it signals the workers)
  void (*fn_)(void *, int, int) = nullptr;
  void *ctx_ = nullptr;
  Team *team_ = nullptr;
  alignas(64) std::atomic<uint32_t> pending_{0};
  std::atomic<uint32_t> done_sleepers_{0};
  std::atomic<bool> stopping_{false};
  pool_detail::Stats *stats_ = nullptr;  // KILN_POOL_STATS
};

/* Opened by a run's entry point (the generated wrapper): kernels called on this thread until
 * it closes use `pool` with the budget requested for this thread (libkiln's per-run budget). */
class RunScope {
 public:
  explicit RunScope(Pool *pool) : saved_(tls()) {
    PoolThread &me = tls();
    me.pool = pool;
    me.budget = requested_threads();
    me.team = nullptr;
    if (pool && pool->stats()) {
      stats_ = pool->stats();
      wall0_ = pool_detail::now_ns();
      cpu0_ = pool_detail::thread_cpu_ns();
    }
  }
  ~RunScope() {
    if (stats_) {
      stats_->runs += 1;
      stats_->run_cpu_ns += pool_detail::thread_cpu_ns() - cpu0_;
      stats_->run_wall_ns += pool_detail::now_ns() - wall0_;
    }
    PoolThread &me = tls();
    me.pool = saved_.pool;
    me.budget = saved_.budget;
    me.team = saved_.team;
  }
  RunScope(const RunScope &) = delete;
  RunScope &operator=(const RunScope &) = delete;

 private:
  PoolThread saved_;
  pool_detail::Stats *stats_ = nullptr;  // KILN_POOL_STATS
  uint64_t wall0_ = 0, cpu0_ = 0;
};

/* Team size a region started here may have: the run's budget, or 1 inside a region or
 * outside a run (and in builds with KILN_SERIAL, Options.openmp=False). */
inline int max_threads() {
#ifdef KILN_SERIAL
  return 1;
#else
  const PoolThread &me = tls();
  return me.pool && !me.team ? me.budget : 1;
#endif
}

/* Team size of a kernel compiled with Options.num_threads = n: n, lowered to this run's
 * thread budget when that is smaller. */
inline int team_cap(int n) {
  const int budget = max_threads();
  return budget < n ? budget : n;
}

namespace pool_detail {
template <class F>
inline void parallel(int nt, F &&f, bool optional) {
  PoolThread &me = tls();
#ifdef KILN_SERIAL
  nt = 1;
#endif
  if (nt <= 1 || !me.pool || me.team) {
    Team solo;  // barrier() and team_critical() work (trivially) in a serial region too
    Team *saved = me.team;
    me.team = &solo;
    struct Restore { PoolThread &me; Team *saved; ~Restore() { me.team = saved; } } r{me, saved};
    f(0, 1);
    return;
  }
  using Fn = typename std::remove_reference<F>::type;
  me.pool->run(nt, [](void *ctx, int t, int m) { (*static_cast<Fn *>(ctx))(t, m); },
               const_cast<void *>(static_cast<const void *>(&f)), optional);
}
}  // namespace pool_detail

/* Runs f(t, m) on a team of m = nt threads (t = 0 on the calling thread); serially, f(0, 1),
 * when nt <= 1, nested or outside a run. The team's members may call barrier() and
 * team_critical(). A team larger than the budget is allowed (an explicit num_threads). */
template <class F>
inline void parallel(int nt, F &&f) {
  pool_detail::parallel(nt, std::forward<F>(f), false);
}

/* The barrier of the calling thread's team (no-op outside a region). */
inline void barrier() {
  if (Team *t = tls().team) t->barrier();
}

/* The mutex of the calling thread's team (OpenMP's `critical`); one per region. */
inline Mutex &team_critical() {
  static thread_local Mutex solo;
  Team *t = tls().team;
  return t ? t->mu : solo;
}

namespace pool_detail {
/* One member's share of a parallel_for, [lo, hi) packed in one word (lo | hi << 32): the owner
 * takes pieces from the front, a member done with its own share takes them from the back. */
struct alignas(64) Share {
  std::atomic<uint64_t> r{0};
  bool take(int64_t g, bool front, int64_t &lo, int64_t &hi) {
    uint64_t v = r.load(std::memory_order_acquire);
    for (;;) {
      const int64_t l = int64_t(v & 0xffffffffu), h = int64_t(v >> 32);
      if (l >= h) return false;
      const int64_t a = front ? l : (h - g > l ? h - g : l), b = front ? (l + g < h ? l + g : h) : h;
      const uint64_t nv = front ? (uint64_t(h) << 32) | uint64_t(b)
                                : (uint64_t(a) << 32) | uint64_t(l);
      if (r.compare_exchange_weak(v, nv, std::memory_order_acq_rel,
                                  std::memory_order_acquire)) {
        lo = a, hi = b;
        return true;
      }
    }
  }
};
}  // namespace pool_detail

/* [0, n) over a team of nt (lowered to n): member t owns the static share [n t / nt,
 * n (t+1) / nt) and runs it front to back in pieces of about an eighth; a member done with its
 * own share then takes pieces from the back of the others'. On an idle machine every member
 * runs its own share (a static schedule: what a thread reads is what it wrote one kernel
 * earlier); a member the OS deschedules (a loaded machine) has its share finished by the
 * others instead of holding the region up. f(lo, hi) may so be called several times per member,
 * on disjoint pieces that together cover [0, n) once; every index's work is the same
 * whichever member runs it, so results do not depend on the schedule. Serial (f(0, n)) when
 * nt <= 1. */
template <class F>
inline void parallel_for(int64_t n, int nt, F &&f) {
  if (n <= 0) return;
  if (int64_t(nt) > n) nt = int(n);
  const PoolThread &me = tls();
  if (nt <= 1 || !me.pool || me.team) {  // serial: one chunk
    f(int64_t(0), n);
    return;
  }
  constexpr int kMaxShares = 16;
  if (nt > kMaxShares || n >= (int64_t(1) << 31)) {  // large teams, huge ranges: static
    parallel(nt, [&](int t, int m) {
      const int64_t lo = n * t / m, hi = n * (t + 1) / m;
      if (lo < hi) f(lo, hi);
    });
    return;
  }
  pool_detail::Share shares[kMaxShares];
  const int m0 = nt;
  for (int t = 0; t < m0; ++t)
    shares[t].r.store((uint64_t(n * (t + 1) / m0) << 32) | uint64_t(n * t / m0),
                      std::memory_order_relaxed);
  const int64_t g = (n / m0 + 7) / 8 > 1 ? (n / m0 + 7) / 8 : 1;  // pieces: ~1/8 of a share
  // optional members: member 0 drains every share, so one that never starts leaves no work
  pool_detail::parallel(nt, [&](int t, int m) {
    int64_t lo, hi;
    if (m != m0) {  // a smaller team than asked (a thread could not start): shares of absent members
      for (int v = 0; v < m0; ++v)
        if (v % m == t)
          while (shares[v].take(g, true, lo, hi)) f(lo, hi);
    }
    while (shares[t].take(g, true, lo, hi)) f(lo, hi);
    for (int k = 1; k < m0; ++k) {
      pool_detail::Share &v = shares[(t + k) % m0];
      while (v.take(g, false, lo, hi)) f(lo, hi);
    }
  }, true);
}

/* Dynamic schedule with chunks of one: f(i) for every i in [0, n), each taken by the next
 * free member of a team of nt. */
template <class F>
inline void parallel_for_dynamic(int64_t n, int nt, F &&f) {
  if (n <= 0) return;
  if (int64_t(nt) > n) nt = int(n);
  std::atomic<int64_t> next{0};
  pool_detail::parallel(nt, [&](int, int) {  // optional members: member 0 takes what is left
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
  }, true);
}

}  // namespace kr

/* The budget entry points libkiln looks up in a model library (dlsym; runtime/src/api.cpp):
 * per calling thread, as OpenMP's omp_set_num_threads / omp_get_max_threads. Printed once per
 * model library (its wrapper). */
#define KILN_POOL_ENTRY_POINTS                                                            \
  extern "C" __attribute__((visibility("default"))) int kiln_pool_get_max_threads(void) { \
    return kr::requested_threads();                                                       \
  }                                                                                       \
  extern "C" __attribute__((visibility("default"))) void kiln_pool_set_num_threads(int n) { \
    kr::tls().requested = n > 0 ? n : 0;                                                  \
  }

#endif
