"""What is made once for a sequence of objects (a step's arrays) and reused while later calls
pass the same objects: a Trainer or Module hands the optimizer the same weight, gradient and
state arrays every step, so handle arrays, groupings and checks need not be rebuilt. Objects
are compared by identity, never by value: comparing 3,000 arrays costs about 45 us here,
reading their shapes through MXNet about 5 ms."""
from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

_T = TypeVar('_T')

#: a cache of `kept`: key -> (the objects, what was made for them)
Cache = Dict[Any, Tuple[List[Any], Any]]


def same(objects: Sequence[Any], others: Sequence[Any]) -> bool:
    """Whether the two sequences hold the same objects, in the same order."""
    return len(objects) == len(others) and all(map(operator.is_, objects, others))


def kept(cache: Cache, key: Any, objects: Sequence[Any], make: Callable[[], _T],
         limit: int = 8, keep_if: Optional[Callable[[], bool]] = None) -> _T:
    """``make()``, kept in `cache` under `key` while calls pass the same `objects` as the
    call that made it; the `limit` most recent keys are kept. `keep_if`, asked when
    something is made: whether to keep it (False: it depends on more than the objects)."""
    entry = cache.get(key)
    if entry is not None and same(objects, entry[0]):
        return entry[1]
    value = make()
    cache.pop(key, None)
    if keep_if is None or keep_if():
        while len(cache) >= limit:       # (two threads may race: pop, not del)
            cache.pop(next(iter(cache), None), None)
        cache[key] = (list(objects), value)
    return value
