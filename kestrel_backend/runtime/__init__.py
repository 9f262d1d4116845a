"""The engine thread's machinery: KV pages, paged attention, image cache, scheduler."""
