"""InfluxDB history: line encoding, transport, on-disk spool and the writer."""
