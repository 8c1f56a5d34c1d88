"""The process's C runtime: glibc's malloc_trim and OpenMP's spin policy (no torch)."""
