"""Fairness state in Redis: the counters, windows and interactions of every replica in one
place, so each ranks tenants by the service the whole cluster gave them.

Every update is one Lua script, so it is atomic against the other replicas' updates:

- service counters: a replica adds service locally as steps end and, once a step (when it
  ranks), sends what it added and reads every counter back in one round trip (``sync``). The
  lift rule (``ServiceCounters``: to the least-served active user, or the most-served for a
  name nobody vouches for) and the sweep of forgettable counters run in the script at a
  user's entry, over the cluster's live requests. So another replica's service reaches a
  ranking at most one step late.
- throttling windows: one sorted set per key, trimmed and counted in the script at each
  arrival, timed by the Redis server's clock (replicas' clocks need not agree);
- open interactions: one key per interaction, expiring after the idle timeout (Redis time
  again). A call whose ``interaction_stage`` says it continues needs no lookup, and each
  step reads the others once.

Redis unreachable: every operation fails open. Counters keep their last cluster values plus
this replica's own service, and what it adds is kept to be sent when Redis answers again.
Windows and interactions fall back to this replica's own. No request waits or fails for it.
The outage is logged once when it starts and once when it ends, and counted in
``quanta_fairness_state_errors_total``. Redis is tried again every ``retry_s``.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

from quanta.policies.fair_state import SWEEP_SLACK, Lift, LocalInteractions, SlidingWindows

log = logging.getLogger(__name__)
T = TypeVar("T")

_SYNC = """
for i = 1, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
return redis.call('HGETALL', KEYS[1])
"""
# KEYS: service, live, last_exit, sweep_at; ARGV: user, lift ("min" or "max"), sweep slack
_ENTER = """
local live = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if live <= 0 then
  local floor = nil
  local users = redis.call('HGETALL', KEYS[2])
  for i = 1, #users, 2 do
    if tonumber(users[i + 1]) > 0 then
      local c = tonumber(redis.call('HGET', KEYS[1], users[i]) or '0')
      if floor == nil or (ARGV[2] == 'max' and c > floor) or (ARGV[2] ~= 'max' and c < floor) then
        floor = c
      end
    end
  end
  if floor == nil then
    local last = redis.call('GET', KEYS[3])
    floor = last and tonumber(redis.call('HGET', KEYS[1], last) or '0') or 0
  end
  local own = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
  if floor > own or redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
    redis.call('HSET', KEYS[1], ARGV[1], tostring(math.max(floor, own)))
  end
end
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
local slack = tonumber(ARGV[3])
local held = redis.call('HLEN', KEYS[1])
if held > tonumber(redis.call('GET', KEYS[4]) or ARGV[3]) then
  local lowest = nil
  local users = redis.call('HGETALL', KEYS[2])
  for i = 1, #users, 2 do
    if tonumber(users[i + 1]) > 0 then
      local c = tonumber(redis.call('HGET', KEYS[1], users[i]) or '0')
      if lowest == nil or c < lowest then lowest = c end
    end
  end
  if lowest ~= nil then
    local last = redis.call('GET', KEYS[3])
    local all = redis.call('HGETALL', KEYS[1])
    for i = 1, #all, 2 do
      local u = all[i]
      if tonumber(all[i + 1]) <= lowest and u ~= last
          and tonumber(redis.call('HGET', KEYS[2], u) or '0') <= 0 then
        redis.call('HDEL', KEYS[1], u)
      end
    end
  end
  redis.call('SET', KEYS[4], tostring(math.max(slack, 2 * redis.call('HLEN', KEYS[1]))))
end
return 1
"""
_LEAVE = """
local left = redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
if left <= 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('SET', KEYS[3], ARGV[1])
end
return left
"""
# KEYS: the window's sorted set; ARGV: window seconds, a unique member
_NOTE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]))
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 1)
return redis.call('ZCARD', KEYS[1])
"""


class RedisState:
    """One Redis server's fairness state, shared by every replica that names its URL."""

    def __init__(
        self, url: str, *, prefix: str = "quanta:fair:", retry_s: float = 5.0, client: Any = None
    ) -> None:
        if client is None:
            import redis

            client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self.url, self.prefix, self.retry_s = url, prefix, retry_s
        self.client = client
        self.errors = 0  # operations that failed open
        self._down_since: float | None = None
        self._scripts = {
            name: client.register_script(body)
            for name, body in (
                ("sync", _SYNC),
                ("enter", _ENTER),
                ("leave", _LEAVE),
                ("note", _NOTE),
            )
        }
        self.service = RedisCounters(self)
        self._windows: dict[tuple[str, float], RedisWindows] = {}
        self._interactions: dict[float, RedisInteractions] = {}

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def windows(self, name: str, window_s: float) -> RedisWindows:
        return self._windows.setdefault((name, window_s), RedisWindows(self, name, window_s))

    def interactions(self, idle_timeout_s: float) -> RedisInteractions:
        return self._interactions.setdefault(
            idle_timeout_s, RedisInteractions(self, idle_timeout_s)
        )

    def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self._scripts[name](keys=keys, args=args)

    def attempt(self, operation: Callable[[], T], fallback: Callable[[], T]) -> T:
        """``operation``'s result, or ``fallback``'s while Redis is unreachable (retried
        every ``retry_s``): fairness degrades to this replica's view, nothing fails."""
        from redis import RedisError

        if self._down_since is not None and time.monotonic() - self._down_since < self.retry_s:
            self.errors += 1
            return fallback()
        try:
            result = operation()
        except RedisError as exc:
            self.errors += 1
            if self._down_since is None:
                log.warning(
                    "fairness state at %s unreachable (%s): each replica ranks by its own "
                    "service until it answers",
                    self.url,
                    exc,
                )
            self._down_since = time.monotonic()
            return fallback()
        if self._down_since is not None:
            log.warning("fairness state at %s answers again", self.url)
            self._down_since = None
        return result


class RedisCounters:
    """``ServiceCounters`` over Redis: local additions sent, and all counters read, once a
    step; entries and exits (the lift rule's bookkeeping) go at once. While Redis is down an
    entry lifts nobody: the counters stay as last read plus this replica's additions."""

    def __init__(self, state: RedisState) -> None:
        self.state = state
        self._snapshot: dict[str, float] = {}
        self._pending: dict[str, float] = defaultdict(float)
        k = state.key
        self._keys = [k("service"), k("live"), k("last_exit"), k("sweep_at")]

    def enter(self, user: str, lift: Lift = "min") -> None:
        self.sync()
        args = [user, lift, SWEEP_SLACK]
        self.state.attempt(lambda: self.state.run("enter", self._keys, args), lambda: None)

    def leave(self, user: str) -> None:
        keys = self._keys[:3]
        self.state.attempt(lambda: self.state.run("leave", keys, [user]), lambda: None)

    def add(self, user: str, amount: float) -> None:
        self._pending[user] += amount

    def of(self, user: str) -> float:
        return self._snapshot.get(user, 0.0) + self._pending.get(user, 0.0)

    def sync(self) -> None:
        sent = dict(self._pending)
        args: list[Any] = [x for user, amount in sent.items() for x in (user, repr(amount))]

        def fetch() -> bool:
            flat = self.state.run("sync", self._keys[:1], args)
            self._snapshot = {flat[i].decode(): float(flat[i + 1]) for i in range(0, len(flat), 2)}
            for user, amount in sent.items():  # NOTE: what was added meanwhile stays pending
                self._pending[user] -= amount
                if abs(self._pending[user]) < 1e-12:
                    del self._pending[user]
            return True

        self.state.attempt(fetch, lambda: False)


class RedisWindows:
    """Arrivals per key over a sliding window, one sorted set per key in Redis."""

    def __init__(self, state: RedisState, name: str, window_s: float) -> None:
        self.state, self.name, self.window_s = state, name, window_s
        self._local = SlidingWindows(window_s)

    def note(self, key: str, now: float) -> int:
        local = self._local.note(key, now)
        zkey = self.state.key("window", self.name, key)
        member = uuid.uuid4().hex

        def remote() -> int:
            return int(self.state.run("note", [zkey], [self.window_s, member]))

        return self.state.attempt(remote, lambda: local)


class RedisInteractions:
    """Open interactions as Redis keys that expire after the idle timeout (Redis time)."""

    def __init__(self, state: RedisState, idle_timeout_s: float) -> None:
        self.state = state
        self.ttl_ms = max(1, math.ceil(idle_timeout_s * 1000))
        self._local = LocalInteractions(idle_timeout_s)
        self._seen_at: float | None = None  # the ``now`` the cache below answers for
        self._cache: dict[str, bool] = {}

    def _key(self, interaction: str) -> str:
        return self.state.key("interaction", interaction)

    def open(self, interaction: str, user: str, now: float) -> None:
        self._local.open(interaction, user, now)
        self._cache[interaction] = True
        key = self._key(interaction)
        self.state.attempt(lambda: self.state.client.set(key, user, px=self.ttl_ms), lambda: None)

    def seen(self, interaction: str, now: float) -> None:
        self._local.seen(interaction, now)
        key = self._key(interaction)
        self.state.attempt(lambda: self.state.client.pexpire(key, self.ttl_ms), lambda: None)

    def close(self, interaction: str) -> None:
        self._local.close(interaction)
        self._cache[interaction] = False
        key = self._key(interaction)
        self.state.attempt(lambda: self.state.client.delete(key), lambda: None)

    def is_open(self, interaction: str, now: float) -> bool:
        if now != self._seen_at:  # NOTE: a ranking asks many times at one ``now``
            self._seen_at, self._cache = now, {}
        if interaction not in self._cache:
            key = self._key(interaction)
            self._cache[interaction] = self.state.attempt(
                lambda: bool(self.state.client.exists(key)),
                lambda: self._local.is_open(interaction, now),
            )
        return self._cache[interaction]

    def expire(self, now: float) -> None:
        self._local.expire(now)  # NOTE: Redis expires its keys itself
