from kvguard.cli import main

main()
