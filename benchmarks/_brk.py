import sys, tempfile, gc, statistics, time
from pathlib import Path
from benchmarks import bench_learned as bl, bench_hook
from benchmarks.bench_hook import CLOCKS, sessions_build
from simulator import engine
from policy.catalog import create_policy
from serving_hook import KVPilotScheduler, with_policy
from serving_hook.config import HookConfig
from serving_hook import host_tier
engine.make_vllm_config()
model = Path(sys.argv[1]) if len(sys.argv) > 1 else bl.make_policy_dir(Path(tempfile.mkdtemp()))
cls = with_policy(KVPilotScheduler, lambda: create_policy("learned", model=str(model), offload=True, host_eviction=True), HookConfig(decision_budget_s=1.0))
bench_hook.clock = CLOCKS["wall"]
holder = {}
orig_make = engine.make_scheduler
def mk(*a, **k):
    s = orig_make(*a, **k); holder['s'] = s; return s
engine.make_scheduler = mk
drive = sessions_build(engine, cls, 128, 0.05, host_policy=True)
s = holder['s']
acc = {}
def wrap(obj, name, key):
    fn = getattr(obj, name)
    def w(*a, **kw):
        t = time.perf_counter()
        try: return fn(*a, **kw)
        finally: acc[key] = acc.get(key, 0) + time.perf_counter() - t
    setattr(obj, name, w)
wrap(s._kvp_admission, 'admit', 'admission')
if s._kvp_retention is not None: wrap(s._kvp_retention, 'before_step', 'retention')
wrap(s, '_kvp_after_schedule', 'after')
lever = host_tier.find_cache_policy(s).kvpilot_lever
wrap(lever, 'order', 'tier.order')
wrap(lever, '_prefixes', 'tier.prefixes')
wrap(s.kvpilot_policy, 'evict_host', 'policy.evict_host')
wrap(s.kvpilot_policy, 'admit', 'policy.admit')
wrap(s._kvp_translate, 'offer', 'translate.offer')
wrap(s._kvp_translate, 'step_started', 'step_started')
wrap(s, 'add_request', 'add_request(x)')
wrap(s, 'update_from_output', 'update_from_output(x)')
for i in range(20): drive(i, False)
parts = {}; hooks = []; sched=[]
gc.disable()
for i in range(200):
    acc.clear()
    dt, st = drive(20 + i, True)
    sched.append(dt); hooks.append(st.last_hook_time_s)
    for k, v in acc.items(): parts.setdefault(k, []).append(v)
gc.enable()
print("schedule median ms", statistics.median(sched)*1e3, "hook", statistics.median(hooks)*1e3)
for k, v in parts.items():
    v = v + [0]*(200-len(v))
    print(f"{k:24s} median {statistics.median(v)*1e3:.3f} mean {statistics.mean(v)*1e3:.3f}")
print("tier inner via guard: n/a")
import cProfile, pstats
pr = cProfile.Profile()
orig = s.kvpilot_policy.admit
def padmit(*a, **k):
    pr.enable()
    try: return orig(*a, **k)
    finally: pr.disable()
s.kvpilot_policy.admit = padmit
for i in range(200): drive(300 + i, True)
pstats.Stats(pr).sort_stats('tottime').print_stats(25)
