from rollq.cli import main

main()
