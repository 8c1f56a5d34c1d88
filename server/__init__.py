"""pagedserve's OpenAI-compatible HTTP server."""
