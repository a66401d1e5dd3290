"""What the client and the coordinator both speak, beyond the generated contract.

`gradsync.v1` holds the messages; this package holds the rules both ends
derive from them: how buffers are cut into chunks (`chunking`), which dtypes
travel and their sizes (`dtypes`), the zero-copy gradient codec (`codec`),
status codes (`codes`), every default value (`defaults`) and the types of
the command-line flags both ends' subcommands take (`flags`); `net` holds
what every process needs beside the wire: dialing a coordinator, and the
Prometheus scrape endpoint (`net.exposition`). Neither end imports the
other's internals; both import this.
"""

#: The software version both ends report (in Welcome, in the shard handshake).
__version__ = "0.1.0"
