"""The API-server side of the request lifecycle: the async engine the server drives, and its interfaces."""
