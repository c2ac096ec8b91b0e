"""The inference node: register with the trainer, pull work, generate with vLLM, submit, follow versions.

One asyncio loop does the I/O (a zmq DEALER to the trainer, HTTP for weights and the status page);
every engine call runs on one dedicated thread, so generation never blocks heartbeats and the engine
is never used from two threads at once. Versions come through the relay tree (broadcast.peer): the
node pins the trainer's key, every piece is checked against the signed manifest, and the node relays
to others unless told not to. A new version is loaded into the running engine, never by a restart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from broadcast.addresses import is_loopback
from broadcast.peer import Peer, PeerConfig
from inference_nodes.episodes import EpisodeRunner
from swarm_common import proof_of_work
from swarm_common import protocol as P
from swarm_common.chat import encode_prompt
from swarm_common.http import start_site
from swarm_common.keys import KeyPair, fingerprint, load_public

log = logging.getLogger(__name__)


class Node:
    def __init__(
        self,
        trainer: str,
        data_dir: str | Path,
        name: str | None = None,
        max_prompts: int = P.DEFAULT_MAX_PROMPTS,
        status_host: str | None = None,
        status_port: int = 0,
        probe_prompt: str = "3+5+8",
        seed: int = 0,
        trainer_key: str | None = None,
        invite: str = "",
        tree: PeerConfig | None = None,
    ):
        """`status_host`: where the status page listens (None: 127.0.0.1 when the trainer is on this
        machine's loopback, else every interface). `tree`: how this node takes part in the relay tree
        (broadcast/config.py: its relay's address, --advertise, timeouts); its name is the node's."""
        self.trainer = trainer if "://" in trainer else f"tcp://{trainer}"
        # The host we reach the trainer at: it tells us the tracker is there too, unless it knows better.
        self.trainer_host = urlsplit(self.trainer).hostname or ""
        self.invite = invite
        local = is_loopback(self.trainer_host)
        status_host = status_host or ("127.0.0.1" if local else "0.0.0.0")
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.key = KeyPair.load_or_create(self.data_dir / "node.key")
        self.node_id = self.key.public_hex
        self.name = name or f"{socket.gethostname()}-{self.node_id[:8]}"
        self.max_prompts = max_prompts
        self.status_host, self.status_port = status_host, status_port
        self.probe_prompt = probe_prompt
        self.seed = seed
        self.pinned = load_public(trainer_key) if trainer_key else None
        self.tree = msgspec.structs.replace(tree or PeerConfig(), name=self.name)
        self.peer: Peer | None = None

        self.engine = None
        self.episodes = EpisodeRunner()  # multi-turn work: the environments the trainer names
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.loaded = -1
        self.latest: P.WeightsInfo | None = None
        self.registered: P.Registered | None = None
        self.status = P.NodeStatus(
            node_id=self.node_id, name=self.name, trainer=self.trainer, version_loaded=-1, versions_loaded=0,
            restarts=0, tokens_generated=0, rollouts_submitted=0, rollouts_accepted=0, tokens_per_s=0.0,
            probes={}, reload_seconds=[],
        )
        self._replies: asyncio.Queue = asyncio.Queue()
        self._stop = asyncio.Event()
        self.status_url = ""
        self.seen_as = ""  # this machine's address as the trainer sees it

    # ---- engine calls, always on the engine thread ------------------------------------------------

    async def _on_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _start_engine(self, model_dir: Path) -> None:
        from inference_nodes.engine import Engine, model_context

        self.engine = Engine(model_dir, seed=self.seed, max_model_len=model_context(model_dir))
        self._probe_ids = encode_prompt(self.engine.tokenizer, self.probe_prompt)

    def _trusted_key(self, offered: str) -> bytes:
        """The trainer key to pin: the one given on the command line, else the one seen first (kept)."""
        offered_key = bytes.fromhex(offered)
        if self.pinned is not None:
            if offered_key != self.pinned:
                raise RuntimeError(f"the trainer offers key {fingerprint(offered_key)}, but we pin "
                                   f"{fingerprint(self.pinned)}: refusing its weights")
            return self.pinned
        seen = self.data_dir / "trainer.pub"
        if seen.exists():
            kept = load_public(str(seen))
            if kept != offered_key:
                raise RuntimeError(f"the trainer's key changed to {fingerprint(offered_key)} (we first saw "
                                   f"{fingerprint(kept)}); pass --trainer-key to accept a new one")
            return kept
        seen.write_text(offered + "\n")
        print(f"first contact: pinned the trainer's key, fingerprint {fingerprint(offered_key)}", flush=True)
        return offered_key

    async def _join_tree(self, reg: P.Registered) -> None:
        if self.peer is not None:
            return
        self.peer = Peer(reg.tracker_url, self.data_dir / "tree", self._trusted_key(reg.trainer_key), self.tree,
                         keypair=self.key, follow=True)
        await self.peer.start()
        self.status.relay_url = self.peer.url or ""
        self.status.relay_reachable = self.peer.reachable

    async def _load(self, info: P.WeightsInfo) -> None:
        """Fetch `info`'s version through the tree (every piece verified), then start or reload the engine."""
        path = await self.peer.fetch(info.version, timeout=600)
        if self.engine is None:
            log.info("starting the engine (vLLM) on version %d", info.version)
            await self._on_engine(self._start_engine, path)
            log.info("engine started on version %d in %.1fs", info.version, self.engine.start_seconds)
        else:
            secs = await self._on_engine(self.engine.reload, path)
            self.status.reload_seconds.append(round(secs, 4))
            log.info("loaded version %d live in %.3fs", info.version, secs)
        self.loaded = info.version
        self.status.version_loaded = info.version
        self.status.versions_loaded += 1

    async def _probe(self) -> None:
        """The status page's greedy completion of the probe prompt with the loaded version, when no work
        came with it to ride along (see _generate)."""
        version = self.loaded
        if version >= 0 and str(version) not in self.status.probes:
            probe = await self._on_engine(self.engine.greedy, [self._probe_ids], 16)
            self.status.probes[str(version)] = probe[0]

    # ---- zmq --------------------------------------------------------------------------------------

    async def _send(self, msg: P.Message) -> None:
        await self.sock.send_multipart(P.sign(msg, self.key))

    async def _receiver(self) -> None:
        """Route replies to whoever waits for them; act on notices at once."""
        while not self._stop.is_set():
            data = await self.sock.recv()
            try:
                msg = P.decode(data)
            except P.ProtocolError as e:
                log.warning("dropped a bad message from the trainer: %s", e)
                continue
            if isinstance(msg, P.VersionNotice):
                if self.latest is None or msg.weights.version > self.latest.version:
                    self.latest = msg.weights
                    log.info("trainer announced version %d", msg.weights.version)
            elif isinstance(msg, P.SubmissionResult):
                self.status.rollouts_accepted += len(msg.accepted)
                for aid, reason in msg.refused.items():
                    log.warning("rollout %s refused: %s", aid, reason)
            elif isinstance(msg, P.Error):
                log.warning("trainer error %s: %s", msg.code, msg.message)
                if msg.code == "unknown_node":
                    self.registered = None  # the trainer restarted or forgot us: register again
                await self._replies.put(msg)
            else:
                await self._replies.put(msg)

    async def _request(self, msg: P.Message, expect: type, timeout: float = 10.0):
        """Send and wait for the reply of type `expect` (an Error reply is returned as is)."""
        await self._send(msg)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                async with asyncio.timeout(left):
                    reply = await self._replies.get()
            except TimeoutError:
                break
            if isinstance(reply, expect | P.Error):
                return reply
        return None

    async def _register(self) -> P.Registered:
        pow_bits, backoff = 0, 1.0
        while not self._stop.is_set():
            time_ms = int(time.time() * 1000)
            nonce = await asyncio.to_thread(proof_of_work.solve, self.node_id, time_ms, pow_bits) if pow_bits else 0
            while not self._replies.empty():  # answers to what we sent before (a restarted trainer's errors)
                self._replies.get_nowait()
            reply = await self._request(
                P.Register(node_id=self.node_id, name=self.name, time_ms=time_ms, max_prompts=self.max_prompts,
                           status_url=self.status_url, trainer_host=self.trainer_host, pow_nonce=nonce,
                           invite=self.invite),
                P.Registered,
            )
            if isinstance(reply, P.Registered):
                log.info("registered with %s as %s (%s)", self.trainer, self.name, self.key.fingerprint)
                if self.latest is None or reply.weights.version > self.latest.version:
                    self.latest = reply.weights
                return reply
            if isinstance(reply, P.Error) and reply.code == "pow_required" and 0 < reply.pow_bits <= 32:
                pow_bits = reply.pow_bits  # the trainer asks for a proof of work: solve it and ask again
                log.info("the trainer asks for a %d-bit proof of work to register; solving it", pow_bits)
                continue
            if reply is None:
                log.info("trainer at %s not answering yet; retrying in %.0fs", self.trainer, backoff)
            elif reply.code in ("invite_required", "banned", "not_allowed"):
                log.error("the trainer refuses this node: %s", reply.message)
            else:
                log.warning("registration refused (%s: %s); retrying in %.0fs", reply.code, reply.message, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0) if reply is None or reply.code != "stale_register" else 1.0
        raise asyncio.CancelledError

    async def _heartbeats(self) -> None:
        while not self._stop.is_set():
            period = self.registered.heartbeat_s if self.registered else 2.0
            await asyncio.sleep(period)
            if self.registered:
                await self._send(P.Heartbeat(node_id=self.node_id, version_loaded=self.loaded,
                                             tokens_per_s=self.status.tokens_per_s))

    async def _work(self) -> None:
        while not self._stop.is_set():
            if self.registered is None:
                self.registered = await self._register()
                await self._join_tree(self.registered)
            if self.latest and self.latest.version > self.loaded:
                try:
                    await self._load(self.latest)
                except Exception as e:  # noqa: BLE001 - a failed fetch is retried, never fatal
                    log.warning("could not load version %d: %s", self.latest.version, e)
                    # It may have been retired meanwhile: the next work reply names the newest.
                    self.latest = None
                    await asyncio.sleep(1.0)
                    continue
            reply = await self._request(
                P.WorkRequest(node_id=self.node_id, version_loaded=self.loaded, max_prompts=self.max_prompts),
                P.WorkAssignment,
            )
            if not isinstance(reply, P.WorkAssignment):
                continue
            if self.latest is None or reply.weights.version > self.latest.version:
                self.latest = reply.weights
            if not reply.assignments:
                await self._probe()
                # The trainer holds a request until there is room (a long poll), then says to ask again
                # at once (0); a bare 0 from a trainer that does not hold requests would spin, hence the floor.
                await asyncio.sleep(min(max(reply.retry_after_s, 0.01), 5.0))
                continue
            if self.loaded < reply.min_version:
                continue  # load the newer version first (top of the loop)
            await self._generate(reply)

    async def _episodes(self, work: P.WorkAssignment) -> None:
        """Multi-turn work: G episodes per assignment, the environment beside the engine (episodes.py)."""
        longest = max(len(a.prompt_token_ids) for a in work.assignments)
        no_item = any(a.item is None for a in work.assignments)
        if longest + work.env.max_episode_tokens > self.engine.max_model_len or no_item:
            log.error("cannot run this work: episodes of %d tokens after a %d-token prompt exceed the engine's "
                      "%d (or an assignment names no item)", work.env.max_episode_tokens, longest,
                      self.engine.max_model_len)
            await asyncio.sleep(5.0)
            return
        t0 = time.perf_counter()
        rollouts, st = await self._on_engine(self.episodes.run, self.engine, work)
        secs = time.perf_counter() - t0
        self.status.tokens_generated += st.sampled_tokens
        self.status.tokens_per_s = st.sampled_tokens / max(secs, 1e-9)
        self.status.episodes += st.episodes
        self.status.turns += st.turns
        self.status.tool_calls += st.tool_calls
        self.status.tool_errors += st.tool_errors
        await self._send(P.RolloutSubmission(node_id=self.node_id, version=self.loaded, rollouts=rollouts,
                                             gen_seconds=secs))
        self.status.rollouts_submitted += len(rollouts)
        await self._probe()

    async def _generate(self, work: P.WorkAssignment) -> None:
        if work.env is not None:
            return await self._episodes(work)
        s = work.sampling
        version = self.loaded
        # The probe rides along with a version's first batch rather than run between loading the version
        # and generating: an on-policy trainer waits for this batch.
        probe = [] if str(version) in self.status.probes else [self._probe_ids]
        t0 = time.perf_counter()
        groups, greedy = await self._on_engine(
            self.engine.generate_batch, [a.prompt_token_ids for a in work.assignments], s.n, s.max_tokens,
            s.temperature, s.top_p, None, probe,
        )
        secs = time.perf_counter() - t0
        if probe:
            self.status.probes[str(version)] = greedy[0]
        ntok = sum(len(x.token_ids) for g in groups for x in g)
        self.status.tokens_generated += ntok
        self.status.tokens_per_s = ntok / max(secs, 1e-9)
        rollouts = [
            P.Rollout(a.assignment_id, [P.Sample(x.token_ids, x.logprobs, x.finish_reason) for x in g])
            for a, g in zip(work.assignments, groups, strict=True)
        ]
        await self._send(P.RolloutSubmission(node_id=self.node_id, version=version, rollouts=rollouts,
                                             gen_seconds=secs))
        self.status.rollouts_submitted += len(rollouts)

    # ---- status page ------------------------------------------------------------------------------

    async def _status_app(self) -> web.AppRunner:
        app = web.Application()

        async def status(_):
            return web.Response(body=msgspec.json.encode(self.status), content_type="application/json")

        app.router.add_get("/status", status)
        runner, port = await start_site(app, self.status_host, self.status_port)
        # Listening on every interface, the page is linked at the address the trainer sees us at.
        host = self.status_host if self.status_host not in ("0.0.0.0", "::") else (self.seen_as or "127.0.0.1")
        self.status_url = f"http://{host}:{port}/status"
        print(f"node status: {self.status_url}", flush=True)
        return runner

    async def _hello(self) -> None:
        """Ask the trainer, before registering, which address it sees us at (for the status page's link)."""
        reply = await self._request(P.Hello(node_id=self.node_id, trainer_host=self.trainer_host), P.Welcome,
                                    timeout=5.0)
        if isinstance(reply, P.Welcome) and P.is_host(reply.seen_as):
            self.seen_as = reply.seen_as

    # ---- main -------------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        ctx = zmq.asyncio.Context()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        self.sock.connect(self.trainer)
        print(f"node key {self.node_id} (fingerprint {self.key.fingerprint}); the operator of a run may trust "
              f"it with: swarm train --trust {self.node_id}", flush=True)
        tasks = [asyncio.create_task(self._receiver())]
        runner = None
        try:
            await self._hello()
            runner = await self._status_app()
            tasks.append(asyncio.create_task(self._heartbeats()))
            work = asyncio.create_task(self._work())
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([work, stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop and t.exception():
                    raise t.exception()
            work.cancel()
        finally:
            for t in tasks:
                t.cancel()
            if self.peer is not None:
                await self.peer.stop()
            if runner is not None:
                await runner.cleanup()
            self.sock.close(0)
            ctx.term()
            self._pool.shutdown(wait=False, cancel_futures=True)
