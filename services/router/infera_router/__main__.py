from infera_router.main import main

main()
