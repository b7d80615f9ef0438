from checkpoint.reading import main

main()
