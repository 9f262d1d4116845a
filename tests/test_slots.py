"""Slots whose limit changes while they are held (kestrel_backend/slots.py): batch lines' image decodes (all decode
threads while nobody is about, all but one while people are) and the Batch API's lines upstream (by ready replicas)."""

import asyncio

from kestrel_backend.slots import Slots


def test_holders_never_pass_the_limit_of_the_moment_and_none_is_lost():
    """Five waiting on a limit of three, which drops to two (people came) while three are held: no fourth gets in,
    and once holders leave no more than two hold at once; all five run."""
    async def run() -> list[int]:
        limit = [3]
        slots, seen = Slots(lambda: limit[0]), []

        async def work(release: asyncio.Event):
            async with slots.slot():
                seen.append(slots.held)
                await release.wait()
        releases = [asyncio.Event() for _ in range(5)]
        tasks = [asyncio.ensure_future(work(r)) for r in releases]
        await asyncio.sleep(0.02)
        assert slots.held == 3
        limit[0] = 2
        for release in releases:
            release.set()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert slots.held == 0
        return seen

    seen = asyncio.run(run())
    assert len(seen) == 5 and seen[:3] == [1, 2, 3] and max(seen[3:]) <= 2


def test_a_limit_that_grows_with_nobody_leaving_is_seen_at_the_next_recheck():
    """No holder leaves, the limit grows (a replica turned ready): a waiter gets in within recheck_s."""
    async def run() -> int:
        limit = [1]
        slots, hold = Slots(lambda: limit[0], recheck_s=0.05), asyncio.Event()

        async def work():
            async with slots.slot():
                await hold.wait()
        tasks = [asyncio.ensure_future(work()) for _ in range(2)]
        await asyncio.sleep(0.02)
        assert slots.held == 1
        limit[0] = 2
        await asyncio.sleep(0.15)
        held = slots.held
        hold.set()
        await asyncio.gather(*tasks)
        return held

    assert asyncio.run(run()) == 2
