"""Run: python benchmarks/gil_release.py

Does a Paddle CPU op release the GIL? A thread runs Paddle ops; the main thread counts pure-Python loop
iterations meanwhile. If the op holds the GIL, the count collapses while it runs."""
import threading, time, paddle, numpy as np
def spin(seconds):
    n = 0; end = time.perf_counter() + seconds
    while time.perf_counter() < end: n += 1
    return n
base = spin(0.5)
for name, fn in [("paddle.matmul [512,1024]x[1024,1024]", lambda a=paddle.randn([512,1024]), b=paddle.randn([1024,1024]): paddle.matmul(a, b)),
                 ("paddle.exp [64,151936]", lambda a=paddle.randn([64,151936]): paddle.exp(a)),
                 ("paddle.gather 256k rows", lambda a=paddle.randn([65536,8]), i=paddle.randint(0,65536,[262144]): paddle.gather(a, i)),
                 ("numpy exp [64,151936]", lambda a=np.random.rand(64,151936).astype(np.float32): np.exp(a))]:
    stop = threading.Event(); calls = [0]
    def work():
        while not stop.is_set(): fn(); calls[0] += 1
    th = threading.Thread(target=work); th.start(); time.sleep(0.05)
    n = spin(0.5); stop.set(); th.join()
    print(f"{name}: Python loop ran at {n / base:.0%} of its speed alone while {calls[0]} op calls ran in a thread")
