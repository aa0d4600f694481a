"""The data-path client interface and its implementations (own HTTP/1.1 client, aiohttp, httpx)."""
