from gpuguard.cli import main

main()
