"""Real servers for tests and benchmarks: a throwaway PostgreSQL cluster, moto's S3 server,
an aiohttp receiver. Nothing here imports gpuid_agent, so the benchmarks can use it too."""
