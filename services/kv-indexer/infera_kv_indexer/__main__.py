from infera_kv_indexer.main import main

main()
