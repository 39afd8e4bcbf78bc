"""EncoderCacheManager: which images' embeddings the worker holds, and the encoder's budget.

Plain Python (the scheduler side). An image is keyed by its identifier (`mm_hash`), so equal
images share one entry: the n children of a request, a preempted request that comes back and
two requests with the same image all reuse one encoder run while the entry lives. Entries are
counted in embedding tokens against `cache_size`:

    referenced entries (a live request still has tokens of the image to compute)
    freeable entries   (no reference left; kept, LRU, until their space is needed)
    free space

An entry is evicted only to make room; evicted identifiers are reported once
(`take_freed_mm_hashes`) so the worker drops their tensors. vLLM's EncoderCacheManager.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.core.request import Request


class EncoderCacheManager:
    """Args:
        cache_size: most embedding tokens held at once (encoder_cache_size).
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        # mm_hash -> ids of the requests that reference it.
        self.cached: dict[str, set[str]] = {}
        # mm_hash -> embedding tokens of entries no request references (oldest first).
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.num_freeable_slots = cache_size
        self._freed: list[str] = []
        # Images encoded since start (a counter for the stats and the tests).
        self.num_encoder_runs = 0

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether feature `input_id` of `request` is cached; if so, `request` references it."""
        mm_hash = request.mm_features[input_id].identifier
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        if not refs:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        refs.add(request.request_id)
        return True

    def can_allocate(self, num_embeds: int, num_embeds_this_step: int) -> bool:
        """Whether an entry of `num_embeds` fits, after `num_embeds_this_step` already
        scheduled in this step; evicts freeable entries (LRU) to make room."""
        need = num_embeds + num_embeds_this_step
        if need > self.num_freeable_slots:
            return False
        while need > self.num_free_slots:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self._freed.append(mm_hash)
            self.num_free_slots += size
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Record feature `input_id` of `request` as encoded this step (referenced by it)."""
        feature = request.mm_features[input_id]
        self.cached.setdefault(feature.identifier, set()).add(request.request_id)
        self.num_free_slots -= feature.num_embeds
        self.num_freeable_slots -= feature.num_embeds
        self.num_encoder_runs += 1

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """Drop `request`'s reference to feature `input_id` (its tokens are all computed)."""
        feature = request.mm_features[input_id]
        refs = self.cached.get(feature.identifier)
        if not refs or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        if not refs:
            self.freeable[feature.identifier] = feature.num_embeds
            self.num_freeable_slots += feature.num_embeds

    def free(self, request: Request) -> None:
        """Drop all of `request`'s references (finished or preempted)."""
        for i in range(len(request.mm_features)):
            self.free_encoder_input(request, i)

    def take_freed_mm_hashes(self) -> list[str]:
        """Identifiers evicted since the last call (the worker drops their embeddings)."""
        freed, self._freed = self._freed, []
        return freed


def schedule_encoder_inputs(request: Request, num_computed_tokens: int, num_new_tokens: int,
                            encoder_budget: int, manager: EncoderCacheManager
                            ) -> tuple[int, list[int], int]:
    """The encoder work of computing tokens [num_computed_tokens, + num_new_tokens) of
    `request` (vLLM's `_try_schedule_encoder_inputs`).

    Every image whose placeholder range overlaps those tokens must have its embeddings cached
    or encoded this step. A `bidirectional` image whose range starts in this chunk must end in
    it too (its tokens attend to each other), else the chunk stops before it. One that is neither cached nor fits the budget or the cache cuts the
    step's tokens just before its range (possibly to 0: the request waits). A chunk may end
    inside an image's range: the embeddings stay cached for the next chunk.

    Returns:
        (tokens to compute, indices of the features to encode this step, budget left). Nothing
        is allocated: the caller commits with `manager.allocate` once the request's KV slots
        are granted.
    """
    if not request.mm_features:
        return num_new_tokens, [], encoder_budget
    end = num_computed_tokens + num_new_tokens
    to_encode: list[int] = []
    scheduled_embeds = 0
    for i, feature in enumerate(request.mm_features):
        start = feature.offset
        if start >= end:
            break
        if start + feature.length <= num_computed_tokens:
            continue
        if feature.bidirectional and num_computed_tokens <= start < end < start + feature.length:
            num_new_tokens = start - num_computed_tokens
            break
        if manager.check_and_update_cache(request, i):
            continue
        if any(request.mm_features[j].identifier == feature.identifier for j in to_encode):
            continue                          # the same image twice in one prompt
        n = feature.num_embeds
        if n > encoder_budget or not manager.can_allocate(n, scheduled_embeds):
            num_new_tokens = max(0, start - num_computed_tokens)
            break
        encoder_budget -= n
        scheduled_embeds += n
        to_encode.append(i)
    return num_new_tokens, to_encode, encoder_budget
