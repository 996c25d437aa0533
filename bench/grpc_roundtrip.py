"""What a Python gRPC round trip costs on this host, without any of treeserve: a server process whose
handler "works" for WORK_MS (sleeping, or spinning), unary calls against one bidirectional stream
carrying a message pair per step, on the sync and the asyncio stacks. Prints the median and mean of
(call wall time - WORK_MS) in ms, per variant.

    python -m bench.grpc_roundtrip WORK_MS [CALLS] [sleep|spin]
    KEEPAWAKE=1 python -m bench.grpc_roundtrip ...   # a thread in each process keeps a core busy
    TRANSPORT=unix python -m bench.grpc_roundtrip ...  # a Unix domain socket instead of TCP on 127.0.0.1
    GRPC_EXPERIMENTS= python -m bench.grpc_roundtrip ...  # gRPC's default transport (EventEngine), not
                                                          # treeserve's (treeserve.grpc_env)
    IDLE_SPINNERS=16 python -m bench.grpc_roundtrip ...  # that many lowest-priority busy loops keep
                                                          # every core out of its idle states ('all':
                                                          # one per core; treeserve.cores, the servers'
                                                          # --keep-cores-awake)

The servers run as child processes of this script (ROLE=sync-server / aio-server in their environment).
"""
from __future__ import annotations

import asyncio
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc

from treeserve.cores import CoreSpinners, spinner_count

WORK_MS = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
WAIT = sys.argv[3] if len(sys.argv) > 3 else "sleep"
WARMUP = 20
PAYLOAD = b"x" * 300  # about a 16-node VerifyRequest


def work() -> None:
    if WAIT == "sleep":
        time.sleep(WORK_MS / 1e3)
    else:  # a thread that spins, as one waiting on a GPU does
        end = time.perf_counter() + WORK_MS / 1e3
        while time.perf_counter() < end:
            pass


def same(x):
    return x


def handlers(unary, bidi) -> grpc.GenericRpcHandler:
    """The test service b.S: U unary, B bidirectional stream (payloads passed through as bytes)."""
    return grpc.method_handlers_generic_handler("b.S", {
        "U": grpc.unary_unary_rpc_method_handler(unary, same, same),
        "B": grpc.stream_stream_rpc_method_handler(bidi, same, same),
    })


def listen(server) -> str:
    """Bind the server; returns the target a client dials."""
    if os.environ.get("TRANSPORT") == "unix":
        target = f"unix:/tmp/grpc_roundtrip_{os.getpid()}.sock"
        server.add_insecure_port(target)
        return target
    return f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"


def serve_sync() -> None:
    def unary(request, context):
        work()
        return PAYLOAD

    def bidi(requests, context):
        for _ in requests:
            work()
            yield PAYLOAD

    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((handlers(unary, bidi),))
    print(listen(server), flush=True)
    server.start()
    server.wait_for_termination()


def serve_aio() -> None:
    async def unary(request, context):
        work()  # on the event loop's thread: no hand-off
        return PAYLOAD

    async def bidi(requests, context):
        async for _ in requests:
            work()
            yield PAYLOAD

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handlers(unary, bidi),))
        print(listen(server), flush=True)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def report(label: str, extra_ms: list[float]) -> None:
    timed = extra_ms[WARMUP:]
    print(f"{label:38s} med/mean {statistics.median(timed):.3f} {statistics.mean(timed):.3f}", flush=True)


def timed(fn) -> list[float]:
    out = []
    for _ in range(WARMUP + CALLS):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3 - WORK_MS)
    return out


async def timed_async(fn) -> list[float]:
    out = []
    for _ in range(WARMUP + CALLS):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1e3 - WORK_MS)
    return out


def sync_client(role: str, target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        unary = channel.unary_unary("/b.S/U", same, same)
        report(f"{role} unary", timed(lambda: unary(PAYLOAD)))
        requests: queue.SimpleQueue = queue.SimpleQueue()

        def feed():
            while (r := requests.get()) is not None:
                yield r

        responses = channel.stream_stream("/b.S/B", same, same)(feed())

        def step():
            requests.put(PAYLOAD)
            return next(responses)

        report(f"{role} bidi stream", timed(step))
        requests.put(None)


async def aio_client(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        unary = channel.unary_unary("/b.S/U", same, same)
        report("aio client + aio server unary", await timed_async(lambda: unary(PAYLOAD)))
        call = channel.stream_stream("/b.S/B", same, same)()

        async def step():
            await call.write(PAYLOAD)
            await call.read()

        report("aio client + aio server bidi stream", await timed_async(step))
        await call.done_writing()


def keep_awake() -> None:
    def spin():
        while True:
            os.sched_yield()  # releases the GIL on every turn

    threading.Thread(target=spin, daemon=True).start()


def main() -> None:
    # busy shell loops at SCHED_IDLE priority (treeserve.cores): any runnable thread preempts them at
    # once, so they cost the measured processes nothing, but no core ever enters an idle state (or, in
    # a virtual machine, halts and exits to the host), which is what waking a thread from idle costs
    if os.environ.get("ROLE") is None and os.environ.get("IDLE_SPINNERS"):
        with CoreSpinners(spinner_count(os.environ["IDLE_SPINNERS"])):
            return main_measured()
    return main_measured()


def main_measured() -> None:
    if os.environ.get("KEEPAWAKE"):
        keep_awake()
    role = os.environ.get("ROLE")
    if role == "sync-server":
        return serve_sync()
    if role == "aio-server":
        return serve_aio()
    for role in ("sync-server", "aio-server"):
        child = subprocess.Popen([sys.executable, "-m", "bench.grpc_roundtrip", *sys.argv[1:]],
                                 env={**os.environ, "ROLE": role}, stdout=subprocess.PIPE, text=True)
        try:
            target = child.stdout.readline().strip()
            sync_client(role, target)
            if role == "aio-server":
                asyncio.run(aio_client(target))
        finally:
            child.kill()
            child.wait()


if __name__ == "__main__":
    main()
