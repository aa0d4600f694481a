"""How one item is served in each mode, with SGLang's PD rules and messages.

null:    queue -> prefill -> decode steps.
prefill: take the room -> wait for a decode to bootstrap (--bootstrap-timeout)
         -> prefill -> send KV -> answer with one token, finish length 0.
decode:  join the room over the KV channel to the prefill's bootstrap server
         (--bootstrap-retries to reach it) -> wait for the KV (--waiting-timeout)
         -> decode steps.
A leg that fails or is cancelled marks its room failed, so the other leg of
the pair fails promptly instead of waiting for its timeout.

A flow is one coroutine. It runs inside the HTTP request's own task for a
single non-streaming item (responses.py) and in a task of its own otherwise;
`job.task` is whichever runs it, and cancelling it (client gone,
/abort_request, shutdown) ends the item. A flow sleeps in `job.wait()` and is
woken by the engine, by its room's listeners and by deadlines.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

from backends.sim.job import ABORT_REASON, Job, SimError
from backends.sim.kvclient import KvTransfer, handshake_failed, transfer_failed
from backends.sim.rooms import DUPLICATE_DECODE, Room
from backends.sim.state import SimState

ABORTED = "Aborted by AbortReq."


def missing_room(rid: str) -> str:
    return ("Invalid request: Disaggregated request received without bootstrap room id. "
            f"req.rid={rid!r}")


def prefill_failed(rid: str, room: int, reason: str) -> str:
    return (f"Prefill bootstrap failed for request rank=0 req.rid={rid!r} "
            f"req.bootstrap_room={room} with exception "
            f"KVTransferError(bootstrap_room={room}): {reason}")


@dataclass
class _Leg:
    """What one item holds in the PD protocol, for cleanup."""

    room: Room | None = None
    decode_room: int | None = None
    transfer: KvTransfer | None = None


def register(state: SimState, job: Job, task: asyncio.Task[object] | None) -> None:
    """Make `job` findable by rid (duplicates, /abort_request, loads) until its flow ends,
    and give it its DP rank as the DataParallelController would (dp.py)."""
    job.task = task
    state.jobs[job.spec.rid] = job
    if state.controller is not None:
        job.rank = state.controller.pick(job.spec)


def launch(state: SimState, job: Job, endpoint: str) -> asyncio.Task[None]:
    """Serve `job` in a task of its own (streams and batches)."""
    task = asyncio.get_running_loop().create_task(run_job(state, job, endpoint))
    register(state, job, task)
    task.add_done_callback(functools.partial(_never_ran, state, job, endpoint))
    return task


def _never_ran(state: SimState, job: Job, endpoint: str, task: asyncio.Task[None]) -> None:
    """End a job whose task was cancelled before its first step (the client left, or
    /abort_request, in the same loop turn as the launch): its coroutine never started, so
    `run_job`'s `finally` never ran, and the job stayed in `state.jobs` (a decode's
    `in_flight` stuck at 1, past its --waiting-timeout).

    mirrors Scheduler.abort_request (managers/scheduler.py), "abort method 1": a request
    that has not started anything is popped from the waiting queue, and its state is still
    cleaned up (an AbortReq sent back to the TokenizerManager)."""
    if task.cancelled() and state.jobs.get(job.spec.rid) is job:  # else run_job ended it
        _settle(state, job, endpoint, _Leg(), *_stopped(state, job))


def interrupt(job: Job, aborted: bool = False) -> None:
    """End a running flow: /abort_request (`aborted`) or the client went away."""
    if job.done or job.task is None:
        return
    if aborted:
        job.aborted = True
    job.task.cancel()


def abort(state: SimState, rid: str | None, abort_all: bool) -> int:
    """POST /abort_request: end matching jobs with finish_reason abort."""
    targets = list(state.jobs.values()) if abort_all else [state.jobs[rid]] if rid in state.jobs else []
    for job in targets:
        interrupt(job, aborted=True)
    return len(targets)


async def run_job(state: SimState, job: Job, endpoint: str) -> None:
    """Serve one item to its end; the outcome is left on the job."""
    leg = _Leg()
    outcome, reason = "completed", None
    runner = _RUNNERS.get(state.config.mode, _run_null)
    try:
        await runner(state, job, leg)
    except SimError as exc:
        job.fail(exc)
        outcome, reason = "failed", exc.message
        state.telemetry.observe_failure(exc.message)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()  # handled here: the task goes on to answer (or not)
        outcome, reason = _stopped(state, job)
    finally:
        _settle(state, job, endpoint, leg, outcome, reason)


def _stopped(state: SimState, job: Job) -> tuple[str, str]:
    """The job was cancelled: aborted (/abort_request) or its client left."""
    state.telemetry.aborted += 1
    if job.aborted:
        job.finish(dict(ABORT_REASON))
        return "aborted", ABORTED
    job.cancel()
    return "cancelled", "client disconnected"


def _settle(state: SimState, job: Job, endpoint: str, leg: _Leg, outcome: str,
            reason: str | None) -> None:
    """Whatever the outcome: out of the engine and the table, the room released, counted."""
    if outcome != "completed":
        state.ranks[job.rank].engine.drop(job)
    _release_leg(state, job, leg, outcome, reason)
    if state.jobs.get(job.spec.rid) is job:
        del state.jobs[job.spec.rid]
    room = job.spec.bootstrap_room if state.config.mode != "null" else None
    state.stats.record(endpoint, job.spec.rid, room, outcome, reason)
    if outcome == "completed":
        state.telemetry.observe_finished(job)


def _release_leg(state: SimState, job: Job, leg: _Leg, outcome: str, reason: str | None) -> None:
    ok = outcome == "completed"
    rank = state.ranks[job.rank]
    if leg.room is not None and rank.registry is not None:
        rank.engine.release(job)
        if not ok:
            why = ABORTED if outcome in ("cancelled", "aborted") else "Prefill bootstrap failed"
            rank.registry.fail(leg.room.room, why)
    if leg.decode_room is not None:
        rank.decode_rooms.discard(leg.decode_room)
        transfer = leg.transfer
        if transfer is not None and not transfer.settled and not ok:
            transfer.abort(reason or ABORTED)


async def _until_done(job: Job) -> None:
    while not job.done:
        await job.wait()


async def _run_null(state: SimState, job: Job, leg: _Leg) -> None:
    if state.config.faults.first_token_delay > 0:  # --first-token-delay
        await asyncio.sleep(state.config.faults.first_token_delay)
    state.ranks[job.rank].engine.submit_prefill(job)
    await _until_done(job)


async def _run_prefill(state: SimState, job: Job, leg: _Leg) -> None:
    spec, cfg, rank = job.spec, state.config, state.ranks[job.rank]
    registry, engine = rank.registry, rank.engine
    if registry is None:
        raise RuntimeError("a prefill sim always has a room registry")
    number = spec.bootstrap_room
    if number is None:
        raise SimError(400, missing_room(spec.rid))
    got = registry.claim_prefill(number, spec.rid)
    if isinstance(got, str):
        raise SimError(500, prefill_failed(spec.rid, number, got))
    leg.room = room = got
    if cfg.num_dp_ranks > 1 and spec.disagg_prefill_dp_rank is None:
        _place_room(state, job, number)
    room.listeners.append(job.wake)  # the decode joined, or the room failed
    job.phase = "bootstrap"
    if room.decode_rid is None and room.state == "open":
        await _wait_for_decode(state, job, room)
    _check_room(room, spec.rid)
    if state.config.faults.first_token_delay > 0:  # --first-token-delay
        await asyncio.sleep(state.config.faults.first_token_delay)
    engine.submit_prefill(job)
    while not job.prefilled:
        await job.wait()
        _check_room(room, spec.rid)
    if job.error is not None:
        raise job.error
    job.phase = "transfer"
    if state.config.faults.withhold_kv:
        await _withhold(state, job)
    seconds = (cfg.transfer_overhead_ms + cfg.transfer_ms_per_token * job.prompt_tokens) / 1e3
    if seconds > 0:
        await asyncio.sleep(seconds)
    kv = {
        "prompt_tokens": job.prompt_tokens, "seed": job.seed.hex(),
        "cached_tokens": job.cached_tokens, "first_token": job.output_ids[0],
        "first_logprob": job.output_logprobs[0], "prefill_rid": spec.rid,
    }
    if not registry.ready(room, kv):
        _check_room(room, spec.rid)
    engine.release(job)
    job.finish({"type": "length", "length": 0})


async def _withhold(state: SimState, job: Job) -> None:
    """--withhold-kv: never send the KV and never answer, until the client leaves.

    mirrors a KV sender stuck mid-transfer (a wedged RDMA/NIXL queue, a lost transfer
    completion): the prefill took the request and its decode joined the room, /health still
    passes, the decode waits for KV until its --waiting-timeout."""
    state.stats.faulted("withheld_kv")
    while True:
        await job.wait()


def _place_room(state: SimState, job: Job, number: int) -> None:
    """Tell decodes where the room's KV is, or fail a room that is on the wrong rank.

    mirrors CommonKVSender.__init__ (disaggregation/common/conn.py): with more than one DP
    rank and no disagg_prefill_dp_rank, a prefill that does not follow rooms registers its
    rank with the bootstrap server (_register_prefill_dp_rank); one that follows rooms but
    was routed elsewhere (routed_dp_rank) fails the room.

    The rank both compare and register is `kv_mgr.attn_dp_rank`, which in 0.5.23 is the rank
    only under attention DP; on plain DP replicas (`--dp-size N`, attn_dp_size 1) it is 0 on
    every replica. So on a plain-DP prefill any room with room % N != 0 fails the conflict check, and a non-following prefill registers rank 0 for
    rooms served by other ranks (their decodes then wait on rank 0). Seen on real 0.5.23 on
    the CPU rig (docs/SIMULATOR.md, "DP ranks"); only disagg_prefill_dp_rank avoids both.
    """
    ranks = state.config.num_dp_ranks
    sender_rank = job.rank if state.config.attn_dp else 0  # kv_mgr.attn_dp_rank
    if not state.config.follow_bootstrap_room:
        if state.bootstrap is not None:
            state.bootstrap.register_dp_rank(number, sender_rank)
    elif sender_rank != number % ranks:
        raise SimError(500, prefill_failed(job.spec.rid, number, (
            f"follow_bootstrap_room conflict: dispatched to dp_rank {sender_rank} but "
            f"bootstrap_room {number} implies dp_rank {number % ranks}. Set "
            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing.")))


async def _wait_for_decode(state: SimState, job: Job, room: Room) -> None:
    """Until a decode joins the room, the room fails, or --bootstrap-timeout passes."""
    started = time.monotonic()
    deadline = state.bootstrap_deadlines.add(job.wake)
    try:
        while room.decode_rid is None and room.state == "open":
            if deadline.expired:
                elapsed = time.monotonic() - started
                raise SimError(500, prefill_failed(
                    job.spec.rid, room.room,
                    f"Request {room.room} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping"))
            await job.wait()
    finally:
        deadline.cancel()


def _check_room(room: Room, rid: str) -> None:
    if room.state == "failed":
        raise SimError(500, prefill_failed(rid, room.room, room.reason or ABORTED))


def _bootstrap_addr(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


async def _run_decode(state: SimState, job: Job, leg: _Leg) -> None:
    spec, client = job.spec, state.client
    if client is None:
        raise RuntimeError("a decode sim always has a bootstrap client")
    number = spec.bootstrap_room
    if number is None:
        raise SimError(400, missing_room(spec.rid))
    if not spec.bootstrap_host or spec.bootstrap_port is None:
        raise SimError(400, "Invalid request: Disaggregated request received without "
                            f"bootstrap host or port. req.rid={spec.rid!r}")
    decode_rooms = state.ranks[job.rank].decode_rooms
    if number in decode_rooms:
        state.stats.rooms_reused += 1
        raise SimError(500, handshake_failed(spec.rid, number, DUPLICATE_DECODE))
    decode_rooms.add(number)
    leg.decode_room = number
    addr = _bootstrap_addr(spec.bootstrap_host, spec.bootstrap_port)
    job.phase = "bootstrap"
    leg.transfer = transfer = await client.join(addr, number, job)
    kind, payload = await transfer.future
    if kind == "refused":
        raise SimError(500, handshake_failed(spec.rid, number, str(payload)))
    if kind == "timeout":
        raise SimError(500, transfer_failed(
            spec.rid, number, f"Request {number} timed out after {payload:.1f}s in KVPoll.WaitingForInput"))
    if kind == "lost":
        raise SimError(500, transfer_failed(
            spec.rid, number, f"Lost connection with prefill instance (bootstrap_addr: {addr})"))
    if kind != "kv":
        raise SimError(500, transfer_failed(spec.rid, number, str(payload)))
    kv = payload
    if int(kv["prompt_tokens"]) != job.prompt_tokens:
        raise SimError(500, transfer_failed(spec.rid, number, (
            f"KV size mismatch: prefill sent {kv['prompt_tokens']} tokens, "
            f"decode expects {job.prompt_tokens}")))
    job.seed = bytes.fromhex(str(kv["seed"]))
    job.cached_tokens = int(kv["cached_tokens"])
    if state.config.faults.first_token_delay > 0:  # --first-token-delay
        await asyncio.sleep(state.config.faults.first_token_delay)
    if spec.max_new_tokens <= 0:
        job.finish({"type": "length", "length": 0})
    else:
        job.first = (int(kv["first_token"]), float(kv["first_logprob"]))
    state.ranks[job.rank].engine.submit_decode(job)
    await _until_done(job)


_RUNNERS = {"prefill": _run_prefill, "decode": _run_decode, "null": _run_null}
