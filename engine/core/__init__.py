"""Scheduling without torch: the scheduler, the block manager and the block allocator (pure Python over ints)."""
