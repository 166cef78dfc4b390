"""`DPRouter`: which data-parallel replica takes a new request (`dp_load_balance`).

    router = DPRouter(num_ranks=2, strategy="least_tokens", req_equiv=512)
    rank = router.route("req-1", num_prompt_tokens=300)   # counted in flight on `rank`
    router.finish("req-1")                                # ... until it finishes or aborts
    router.frame()                                        # per rank: requests, tokens, score

The strategies, as the configuration guide defines them (load = the requests routed to a
replica and not finished yet, "in flight"):
- ``round_robin``: ranks in turn, whatever their load.
- ``least_requests`` (default): the fewest in-flight requests; ties go to the lighter
  in-flight prompt-token load, then to the lower rank.
- ``least_tokens``: the lowest ``sum_prompt_tokens + ATOM_DP_LB_REQ_EQUIV * num_reqs``
  (in-flight prompt tokens, plus a fixed cost per in-flight request); ties to the lower rank.
"""
from __future__ import annotations

from atom.config_checks import _invalid

STRATEGIES = ("round_robin", "least_requests", "least_tokens")


class DPRouter:
    def __init__(self, num_ranks: int, strategy: str = "least_requests", req_equiv: int | None = None):
        if strategy not in STRATEGIES:
            raise _invalid("dp_load_balance", strategy, f"choose one of {', '.join(STRATEGIES)}")
        if req_equiv is None:
            from atom.utils import envs
            req_equiv = envs.ATOM_DP_LB_REQ_EQUIV
        if not isinstance(req_equiv, int) or req_equiv < 0:
            raise _invalid("ATOM_DP_LB_REQ_EQUIV", req_equiv, "must be an int >= 0")
        self.num_ranks, self.strategy, self.req_equiv = num_ranks, strategy, req_equiv
        self.num_reqs = [0] * num_ranks
        self.prompt_tokens = [0] * num_ranks
        self.in_flight: dict[str, tuple[int, int]] = {}  # request id -> (rank, prompt tokens)
        self.routed = [0] * num_ranks  # over the router's life
        self._next = 0

    def score(self, rank: int):
        """What the strategy minimizes for `rank` (lower ranks win ties)."""
        if self.strategy == "least_requests":
            return (self.num_reqs[rank], self.prompt_tokens[rank])
        if self.strategy == "least_tokens":
            return self.prompt_tokens[rank] + self.req_equiv * self.num_reqs[rank]
        return 0

    def choose(self) -> int:
        """The rank the next request goes to (without counting it)."""
        if self.strategy == "round_robin":
            return self._next
        return min(range(self.num_ranks), key=lambda r: (self.score(r), r))

    def route(self, request_id: str, num_prompt_tokens: int) -> int:
        if request_id in self.in_flight:
            raise ValueError(f"request_id={request_id!r} is already in flight on rank {self.in_flight[request_id][0]}")
        rank = self.choose()
        if self.strategy == "round_robin":
            self._next = (self._next + 1) % self.num_ranks
        self.in_flight[request_id] = (rank, num_prompt_tokens)
        self.num_reqs[rank] += 1
        self.prompt_tokens[rank] += num_prompt_tokens
        self.routed[rank] += 1
        return rank

    def finish(self, request_id: str) -> int | None:
        """The request left its replica (finished or aborted); its rank, None if unknown."""
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            return None
        rank, tokens = entry
        self.num_reqs[rank] -= 1
        self.prompt_tokens[rank] -= tokens
        return rank

    def rank_of(self, request_id: str) -> int | None:
        entry = self.in_flight.get(request_id)
        return None if entry is None else entry[0]

    def frame(self):
        """A DataFrame: per rank, in-flight requests and prompt tokens, score, routed so far."""
        import pandas as pd
        return pd.DataFrame([{"rank": r, "num_reqs": self.num_reqs[r], "prompt_tokens": self.prompt_tokens[r],
                              "score": self.score(r), "routed": self.routed[r]} for r in range(self.num_ranks)])

    def __repr__(self) -> str:
        return (f"DPRouter(strategy={self.strategy!r}, num_ranks={self.num_ranks}, num_reqs={self.num_reqs}, "
                f"prompt_tokens={self.prompt_tokens})")
