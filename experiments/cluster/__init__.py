"""The emulated cluster (`emulation`: network namespaces joined by shaped links), the timed
collectives on it (`probe`), the cost model's report and projection (`report`,
`projection`), and ``gracecomm-netbench`` (`netbench`: methods trained on a shaped link)."""
